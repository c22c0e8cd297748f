#!/usr/bin/env python
"""Does training move reward? Run exp/cpu_learning.yaml and its sign-flipped twin on CPU and compare.

Both runs go through the launcher: the real trainer, agent loop and environment service, the same warm-started
tiny model (built once, cached under outputs/), GRPO on the same 2 train tasks. For each run the reward of every
training episode is read from the run's rollout dump (``<run_dir>/rollout_log/<step>.jsonl``, verl's
``trainer.rollout_data_dir``), and the mean reward of the episodes of the last ``--window`` steps is compared
with that of the first ``--window`` steps; the standard error of each window mean is the episodes' standard
deviation over the square root of their number.

Pass: the normal run rises by more than ``--sigmas`` standard errors and by at least ``--margin``, and the flipped
run does not (its difference stays below the same bar). Exit status 0 on pass, 1 on fail. A comparison figure
(reward over steps, both runs, ± one standard error) is written to ``<out>/reward_normal_vs_flipped.png``.

    python scripts/learning_check.py --out experiments/learning_check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from seal.figures import _figure, _save  # noqa: E402

RECIPES = {"normal": "exp/cpu_learning.yaml", "flipped": "exp/cpu_learning_flipped.yaml"}


def run(name: str, out: Path, extra: list[str]) -> float:
    """One launcher run into ``out/name``; returns its wall time in seconds."""
    run_dir = out / name
    log = out / f"{name}.log"
    cmd = [
        sys.executable,
        str(ROOT / "launcher.py"),
        "--conf",
        str(ROOT / RECIPES[name]),
        f"seal.run_dir={run_dir}",
        f"trainer.default_local_dir={out / 'checkpoints' / name}",
        *extra,
    ]
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ}).returncode
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name} run failed (exit {rc}); log {log}:\n{tail}")
    return time.perf_counter() - start


def episode_rewards(run_dir: Path) -> dict[int, list[float]]:
    """{step: [reward of each training episode of that step]} from the run's rollout dump."""
    steps = {}
    for path in (run_dir / "rollout_log").glob("*.jsonl"):
        with open(path) as f:
            steps[int(path.stem)] = [float(json.loads(line)["score"]) for line in f if line.strip()]
    return dict(sorted(steps.items()))


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation over sqrt(n))."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def compare(steps: dict[int, list[float]], window: int) -> dict:
    """First-``window``-steps against last-``window``-steps mean episode reward, with standard errors."""
    if len(steps) < 2 * window:
        raise SystemExit(f"only {len(steps)} steps logged; need at least {2 * window}")
    rewards = list(steps.values())
    first, first_se = mean_se([r for step in rewards[:window] for r in step])
    last, last_se = mean_se([r for step in rewards[-window:] for r in step])
    return {
        "first": first,
        "first_se": first_se,
        "last": last,
        "last_se": last_se,
        "diff": last - first,
        "diff_se": math.hypot(first_se, last_se),
    }


def rises(result: dict, sigmas: float, margin: float) -> bool:
    return result["diff"] > sigmas * result["diff_se"] and result["diff"] >= margin


def plot(series: dict[str, dict[int, list[float]]], path: Path) -> str:
    fig = _figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for name, steps in series.items():
        stats = [mean_se(rewards) for rewards in steps.values()]
        mean, se = [m for m, _ in stats], [e for _, e in stats]
        line = ax.plot(list(steps), mean, marker="o", markersize=3, label=name)[0]
        low, high = [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)]
        ax.fill_between(list(steps), low, high, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("global step")
    ax.set_ylabel("mean episode reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("GRPO on CPU: training reward per step (± one standard error)")
    ax.legend(fontsize=8)
    return _save(fig, str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/learning_check", help="where both runs and the figure go")
    parser.add_argument("--window", type=int, default=3, help="steps at the start and at the end to compare")
    parser.add_argument("--sigmas", type=float, default=2.0, help="a rise must exceed this many standard errors")
    parser.add_argument("--margin", type=float, default=0.15, help="and be at least this much reward")
    parser.add_argument("--reuse", action="store_true", help="only analyse runs already in --out")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    wall = {}
    for name in RECIPES:
        if not args.reuse:
            wall[name] = run(name, out, args.overrides)
    series = {name: episode_rewards(out / name) for name in RECIPES}
    results = {name: compare(steps, args.window) for name, steps in series.items()}
    figure = plot(series, out / "reward_normal_vs_flipped.png")

    k = args.window
    for name, r in results.items():
        print(
            f"{name:8s} first {k} steps {r['first']:.3f} ± {r['first_se']:.3f}   last {k} steps {r['last']:.3f} "
            f"± {r['last_se']:.3f}   difference {r['diff']:+.3f} ± {r['diff_se']:.3f}"
            + (f"   wall {wall[name]:.0f} s" if name in wall else "")
        )
    # not part of the verdict: how far apart the two runs ended (the same start, opposite updates)
    gap, gap_se = (
        results["normal"]["last"] - results["flipped"]["last"],
        math.hypot(results["normal"]["last_se"], results["flipped"]["last_se"]),
    )
    print(f"last {k} steps, normal - flipped: {gap:+.3f} ± {gap_se:.3f}")
    normal_rises = rises(results["normal"], args.sigmas, args.margin)
    flipped_rises = rises(results["flipped"], args.sigmas, args.margin)
    verdict = normal_rises and not flipped_rises
    summary = {
        "passed": verdict,
        "window": k,
        "sigmas": args.sigmas,
        "margin": args.margin,
        "results": results,
        "last_normal_minus_flipped": {"diff": gap, "diff_se": gap_se},
        "mean_reward_per_step": {name: {s: mean_se(r)[0] for s, r in steps.items()} for name, steps in series.items()},
        "wall_s": wall,
        "figure": figure,
    }
    (out / "learning_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"figure: {figure}")
    print(
        f"normal rises: {normal_rises}; flipped rises: {flipped_rises} "
        f"(rise = difference > {args.sigmas} SE and >= {args.margin}) -> {'PASS' if verdict else 'FAIL'}"
    )
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
