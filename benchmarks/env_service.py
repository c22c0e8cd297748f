"""Environment-service throughput and memory, in one run.

    python benchmarks/env_service.py            # full: 400 held-out tasks, 5,000-episode memory run
    python benchmarks/env_service.py --quick    # smoke version (a test runs it so the script cannot rot)

Measures, on the ground-truth replay of the held-out split (every episode: create, one message per GT
turn with the calls plus one plain-text message per turn, evaluate, release):

1. episodes/s in-process (``InProcessEnvClient``, one thread: the GIL makes more threads pointless);
2. episodes/s over HTTP against a service subprocess, at concurrency 1 and 32;
3. episodes/s of bare bfcl-eval: ``multi_turn_checker`` on the same GT (one step per turn, fresh model
   name per entry, registry cleanup) — the verifier alone, without parsing, turns or our isolation;
4. the service's RSS after 500 and after 5,000 episodes (a fresh service subprocess; psutil).

Targets: HTTP@32 within 3x of in-process (slowdown = in-process eps / HTTP@32 eps <= 3), memory flat
(RSS after 5,000 / after 500 close to 1). Exit code 1 when a replay has errors or unexpected failures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from env_service import _bfcl  # noqa: E402,F401  (sets BFCL_PROJECT_ROOT before any bfcl import)
from env_service import replay, tasks  # noqa: E402
from env_service.client import EnvClient, InProcessEnvClient  # noqa: E402

SLOWDOWN_TARGET = 3.0
MEMORY_TARGET = 1.25


# ---------------------------------------------------------------------------------------------
# Service subprocess
# ---------------------------------------------------------------------------------------------


class ServiceProcess:
    """``python -m env_service serve`` on a free port; stopped on exit."""

    def __init__(self):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "env_service", "serve", "--port", str(self.port), "--log-level", "warning"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def __enter__(self) -> "ServiceProcess":
        client = EnvClient(self.url, retries=0, timeout_s=5)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                client.health()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise RuntimeError("service did not start within 60 s") from None
                time.sleep(0.2)

    def rss_mib(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def __exit__(self, *exc_info) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def timed_replay(client, task_ids: list[str], concurrency: int) -> dict:
    started = time.perf_counter()
    results = replay.replay_split(client, task_ids, concurrency=concurrency)
    seconds = time.perf_counter() - started
    summary = replay.summarize(results)
    return {"episodes": len(results), "seconds": seconds, "eps": len(results) / seconds,
            "passed": summary["total"]["passed"], "ok": summary["ok"]}


def bare_checker(task_ids: list[str]) -> dict:
    """bfcl-eval alone: multi_turn_checker on the GT, fresh model name per entry, then cleanup."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    entries, answers = {}, {}
    for category in tasks.CATEGORIES:
        bfcl_category = f"multi_turn_{category}"
        for entry in _bfcl.load_dataset_entry(bfcl_category, include_prereq=False,
                                              include_language_specific_hint=False):
            entries[entry["id"]] = entry
        for answer in _bfcl.load_ground_truth_entry(bfcl_category):
            answers[answer["id"]] = answer["ground_truth"]
    registry = vars(multi_turn_utils)
    passed = 0
    started = time.perf_counter()
    for n, task_id in enumerate(task_ids):
        gt = answers[task_id]
        model_name = f"bench_{n}"
        result = multi_turn_checker([[turn] for turn in gt], gt, entries[task_id], task_id.rsplit("_", 1)[0],
                                    model_name)
        passed += bool(result["valid"])
        for key in [k for k in registry if k.startswith(model_name + "_")]:
            del registry[key]
    seconds = time.perf_counter() - started
    return {"episodes": len(task_ids), "seconds": seconds, "eps": len(task_ids) / seconds, "passed": passed,
            "ok": True}


def memory_run(task_ids: list[str], first: int, total: int, concurrency: int) -> dict:
    """RSS of a fresh service after ``first`` and after ``total`` GT episodes (tasks cycled)."""
    cycle = list(itertools.islice(itertools.cycle(task_ids), total))
    with ServiceProcess() as service, EnvClient(service.url, pool_size=concurrency) as client:
        rss_start = service.rss_mib()
        a = replay.replay_split(client, cycle[:first], concurrency=concurrency)
        rss_first = service.rss_mib()
        b = replay.replay_split(client, cycle[first:], concurrency=concurrency)
        rss_total = service.rss_mib()
        live = client.health()["live"]
    ok = replay.summarize(a + b)["ok"]
    return {"start_mib": rss_start, "first": first, "first_mib": rss_first, "total": total,
            "total_mib": rss_total, "ratio": rss_total / rss_first, "live_after": live, "ok": ok}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def run(quick: bool) -> dict:
    task_ids = tasks.task_ids("heldout")
    if quick:
        task_ids = task_ids[::25]  # 16 tasks, all four categories
    mem_first, mem_total = (50, 200) if quick else (500, 5000)

    InProcessEnvClient().health()
    replay.replay_split(InProcessEnvClient(), task_ids[:8])  # warm-up: imports, task cache, method tables
    figures = {"tasks": len(task_ids), "in_process": timed_replay(InProcessEnvClient(), task_ids, 1)}
    with ServiceProcess() as service:
        for concurrency in (1, 32):
            with EnvClient(service.url, pool_size=concurrency) as client:
                figures[f"http_c{concurrency}"] = timed_replay(client, task_ids, concurrency)
    figures["bare_checker"] = bare_checker(task_ids)
    figures["memory"] = memory_run(task_ids, mem_first, mem_total, concurrency=32)
    inproc, http32 = figures["in_process"]["eps"], figures["http_c32"]["eps"]
    figures["ratios"] = {
        "http32_over_in_process": http32 / inproc,
        "slowdown_http32": inproc / http32,
        "in_process_over_bare": inproc / figures["bare_checker"]["eps"],
    }
    return figures


def report(figures: dict) -> str:
    rows = [("in-process (1 thread)", figures["in_process"]), ("HTTP, concurrency 1", figures["http_c1"]),
            ("HTTP, concurrency 32", figures["http_c32"]), ("bare bfcl multi_turn_checker", figures["bare_checker"])]
    lines = [f"GT replay of {figures['tasks']} held-out tasks "
             f"(create + steps + evaluate + release per episode; cpus={os.cpu_count()})", "",
             f"{'path':<32}{'episodes':>9}{'seconds':>10}{'episodes/s':>12}{'passed':>8}"]
    for name, r in rows:
        lines.append(f"{name:<32}{r['episodes']:>9}{r['seconds']:>10.2f}{r['eps']:>12.1f}{r['passed']:>8}")
    ratios, mem = figures["ratios"], figures["memory"]
    slow_ok = ratios["slowdown_http32"] <= SLOWDOWN_TARGET
    mem_ok = mem["ratio"] <= MEMORY_TARGET
    lines += [
        "",
        f"HTTP@32 / in-process throughput : {ratios['http32_over_in_process']:.2f} "
        f"(slowdown {ratios['slowdown_http32']:.2f}x; target <= {SLOWDOWN_TARGET:.0f}x: "
        f"{'MET' if slow_ok else 'MISSED'})",
        f"in-process / bare checker       : {ratios['in_process_over_bare']:.2f} "
        f"(bare checker is {1 / ratios['in_process_over_bare']:.1f}x faster: it skips parsing, turns, "
        f"isolation and tags)",
        "",
        f"service RSS: start {mem['start_mib']:.1f} MiB, after {mem['first']} episodes {mem['first_mib']:.1f} MiB, "
        f"after {mem['total']} episodes {mem['total_mib']:.1f} MiB",
        f"RSS ratio {mem['total']}/{mem['first']}: {mem['ratio']:.3f} "
        f"(target <= {MEMORY_TARGET}: {'MET' if mem_ok else 'MISSED'}); live episodes after: {mem['live_after']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 tasks, memory after 50 vs 200 episodes")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    print(report(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    replays_ok = all(figures[k]["ok"] for k in ("in_process", "http_c1", "http_c32", "memory"))
    return 0 if replays_ok else 1


if __name__ == "__main__":
    sys.exit(main())
