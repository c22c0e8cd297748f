"""The env-service benchmark still runs (``--quick``: 16 tasks, small memory run) and reports every figure.

No thresholds are asserted here: timings on a shared CI machine are noise. The full run's numbers
are recorded in the benchmark's docstring / the project report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_benchmark_quick_runs(tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "benchmarks/env_service.py", "--quick", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for needle in (
        "in-process",
        "HTTP, concurrency 1",
        "HTTP, concurrency 32",
        "bare bfcl multi_turn_checker",
        "HTTP@32, --workers 1",
        "HTTP@32, --workers 2",
        "--workers 2 / --workers 1",
        "HTTP@32 / in-process",
        "in-process / bare checker",
        "hostile neighbour",
        "innocent client per attack class",
        "RSS ratio",
    ):
        assert needle in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["tasks"] == 16
    for key in ("in_process", "http_c1", "http_c32", "workers_1", "workers_2", "bare_checker"):
        assert figures[key]["passed"] == 16 and figures[key]["eps"] > 0
    hostile = figures["hostile"]
    assert hostile["hostile_messages"] > 0 and hostile["innocent_valid"] == hostile["innocent_episodes"] > 0
    assert hostile["hostile_mean_s"] < 10 * hostile["budget_s"]  # a budget-busting message is stopped
    assert figures["memory"]["live_after"] == 0 and figures["memory"]["ratio"] > 0
    for name, attack in figures["attacks"].items():  # nothing one client does loses another's episode
        assert attack["innocent_lost"] == 0 and attack["innocent_valid"] == attack["innocent_episodes"] > 0, name
