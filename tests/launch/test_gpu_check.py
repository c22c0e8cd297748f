"""scripts/gpu_check.py on CPU: its skip mode end to end (the summary a machine without a GPU writes), and the logic
of its GPU steps on made-up measurements (nvidia-smi's output, verl's metrics, the A-Patch result)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import REPO, repo_environment

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

GIB = 1024**3
NAMES = ["install", "model", "estimate", "gpu_smoke", "weight_sync", "memory_ratio", "apatch_exact"]


def summary_of(out) -> dict[str, tuple[str, str]]:
    rows = [line.split(": ", 1) for line in (out / "summary.txt").read_text().splitlines()]
    return {name: tuple(rest.split(" | ", 1)) for name, rest in rows}


def test_the_skip_mode_writes_every_line_with_the_gpu_steps_skipped(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path), "--skip-gpu"],
        env=repo_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = summary_of(tmp_path)
    assert list(found) == NAMES
    assert found["install"][0] == "ok" and "verl 0.9.1" in found["install"][1]
    assert found["model"][1].startswith("the tiny model built offline")  # this machine has no hub model
    assert found["estimate"][0] == "ok" and found["estimate"][1].endswith("(the higher of rollout and training peak)")
    assert all(found[name] == ("skipped", "--skip-gpu") for name in NAMES[3:])


def test_nvidia_smi_memory_is_read_per_gpu_in_bytes():
    assert gpu_check.parse_memory_used("1024\n 2048\n") == [GIB, 2 * GIB]


def metrics(run_dir, records):
    run_dir.mkdir()
    (run_dir / "metrics_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("peak_gib, status", [(30, "ok"), (50, "failed")])
def test_the_smoke_lines_from_a_run_measured(tmp_path, monkeypatch, peak_gib, status):
    estimate = 40 * GIB
    peaks = [peak_gib * GIB, 3 * GIB]
    monkeypatch.setattr(gpu_check, "run_smoke", lambda out, overrides: (0, peaks, 123.0))
    steps = [{"step": s, "data": {"training/global_step": s, "timing_s/update_weights": 0.5 * s}} for s in (1, 2)]
    metrics(tmp_path / "run", [{"step": 0, "data": {"val-core/x": 0.0}}, *steps])
    summary = gpu_check.Summary(tmp_path / "summary.txt")
    gpu_check.smoke_lines(summary, tmp_path, [], estimate)
    found = summary_of(tmp_path)
    assert found["gpu_smoke"][0] == "ok" and "2 training step(s)" in found["gpu_smoke"][1]
    assert found["weight_sync"] == ("ok", "2 sync(s), 0.5 s, 1.0 s")
    assert found["memory_ratio"][0] == status
    assert found["memory_ratio"][1].startswith(f"{peak_gib / 40:.2f} (peak {peak_gib:.1f} GiB")


def test_a_smoke_run_without_its_steps_fails_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_smoke", lambda out, overrides: (-1, [], 390.0))
    metrics(tmp_path / "run", [])
    summary = gpu_check.Summary(tmp_path / "summary.txt")
    gpu_check.smoke_lines(summary, tmp_path, [], 40 * GIB)
    found = summary_of(tmp_path)
    assert found["gpu_smoke"][0] == "failed" and found["gpu_smoke"][1].startswith("timed out")
    assert found["weight_sync"] == ("failed", "none in the metrics")
    assert found["memory_ratio"] == ("failed", "no peak measured")
    assert summary.failed


def test_the_negative_controls_counted_per_condition():
    def condition(ones, off):
        return {"arms": {"ones": {"metric": ones}, "off": {"metric": off}}}

    result = {"seeds": {"1001": {"conditions": {"a": condition([1, 2], [1, 2]), "b": condition([1, 3], [1, 2])}}}}
    assert gpu_check.negative_controls(result) == (1, 2)
