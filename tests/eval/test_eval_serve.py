"""``seal.eval endpoint --serve``: the served model is started, watched and stopped by the evaluation
(``seal/eval/serve.py``). The server here is a real process answering as vLLM's does (the stub endpoint's own
``__main__``); what differs on a GPU node is only the command, ``vllm serve``."""

from __future__ import annotations

import json
import sys
import time

import pytest
import requests

from seal.eval import serve
from seal.eval.__main__ import main
from seal.eval.stub_endpoint import AGENT_MODEL


def stub_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "seal.eval.stub_endpoint", "--port", str(port)]


def test_the_server_answers_inside_the_block_and_is_gone_after_it(tmp_path):
    port = serve.free_port()
    url = f"http://127.0.0.1:{port}/v1"
    with serve.served(stub_argv(port), url, str(tmp_path / "serve.log"), startup_s=60) as served_url:
        assert served_url == url
        assert requests.get(f"{url}/models", timeout=5).json()["data"][0]["id"] == AGENT_MODEL
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/models", timeout=5)


def test_a_server_that_exits_before_it_answers_is_named_with_its_log(tmp_path):
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-c", "print('CUDA out of memory', flush=True); raise SystemExit(3)"]
    with pytest.raises(serve.ServeFailed) as failed:
        with serve.served(argv, "http://127.0.0.1:9/v1", str(log), startup_s=60):
            pytest.fail("the block must not run")
    assert "exited before it answered (exit 3)" in str(failed.value)
    assert str(log) in str(failed.value) and "CUDA out of memory" in str(failed.value)


def test_a_server_that_dies_during_the_evaluation_is_named_when_it_ends(tmp_path):
    port = serve.free_port()
    dies = ["timeout", "2", *stub_argv(port)]  # up, then gone two seconds later
    with pytest.raises(serve.ServeFailed, match="stopped during the evaluation"):
        with serve.served(dies, f"http://127.0.0.1:{port}/v1", str(tmp_path / "serve.log"), startup_s=60):
            time.sleep(3)


def test_endpoint_serve_runs_the_evaluation_against_the_model_it_serves(tmp_path, monkeypatch, capsys, tiny_dir):
    checkpoint = tmp_path / "best" / "huggingface"  # no weights: the stub serves it; its tokenizer is the tiny model's
    checkpoint.mkdir(parents=True)
    served_argv = []

    def stub_instead_of_vllm(model, name, port, parser, max_model_len):
        served_argv.append((model, name, parser, max_model_len))
        return stub_argv(port)

    monkeypatch.setattr(serve, "vllm_argv", stub_instead_of_vllm)
    out = tmp_path / "out"
    argv = ["endpoint", "--serve", str(checkpoint), "--model", AGENT_MODEL, "--tool-call-parser", "pythonic"]
    argv += ["--tokenizer", str(tiny_dir)]
    assert main([*argv, "--ids", "multi_turn_base_0", "--out", str(out), "--no-progress", "--no-bfcl"]) == 0
    assert served_argv == [(str(checkpoint), AGENT_MODEL, "pythonic", serve.DEFAULT_MAX_MODEL_LEN)]
    record = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert record["task_id"] == "multi_turn_base_0" and "serving:" in capsys.readouterr().out
    assert (out / "serve.log").exists()
