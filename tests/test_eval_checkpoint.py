"""``python -m seal.eval checkpoint`` on CPU: the tiny model through the launcher, Ray, verl's validation, our agent
loop and the launcher's environment service; per-episode records from the agent loop; the table equals the
run's own validation metrics; a rerun skips what is finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seal.eval.records import load_records
from seal.eval.runs import read_metrics, validation_steps

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TASKS = ["multi_turn_base_107", "multi_turn_miss_func_121"]  # a held-out and a train task, short prompts


def run_eval(out: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "seal.eval",
        "checkpoint",
        "--ids",
        ",".join(TASKS),
        "--max-model-calls",
        "2",
        "--out",
        str(out),
        "--no-progress",
    ]
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def test_checkpoint_eval_scores_what_validation_scored(tmp_path):
    out = tmp_path / "eval"
    proc = run_eval(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["task_id"]: r for r in load_records(str(out / "results.jsonl"))}
    assert sorted(records) == sorted(TASKS)
    for r in records.values():
        assert not r["failed"], r["error"]
        assert r["source"]["mode"] == "checkpoint" and 1 <= r["model_calls"] <= 2
        assert r["tokens"]["prompt"] > 500 and r["tokens"]["completion"] > 0
        assert r["turns"][0] and all(step["reply"] for step in r["turns"][0]) and r["tags"]
    validation = validation_steps(read_metrics(str(out / "run")))
    assert list(validation) == [0]  # validation only, nothing trained
    table = json.loads((out / "table.json").read_text())["table"]
    assert {c: table[c]["accuracy"] for c in validation[0]} == validation[0]
    bfcl = json.loads((out / "bfcl" / "score.json").read_text())
    assert {c: s["correct_count"] for c, s in bfcl.items()} == {c: table[c]["passed"] for c in bfcl}
    again = run_eval(out)  # everything finished: no new run
    assert again.returncode == 0 and "2 already in" in again.stdout and "ray init" not in again.stdout
