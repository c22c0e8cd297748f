#!/usr/bin/env python
"""Does training move reward? Run exp/cpu_learning.yaml and its sign-flipped twin on CPU and compare.

Both runs go through the launcher: the real trainer, agent loop and environment service, the same warm-started
tiny model (built once, cached under outputs/), GRPO on the same train task. For each run the reward of every
training episode is read from the run's rollout dump (``<run_dir>/rollout_log/<step>.jsonl``, verl's
``trainer.rollout_data_dir``), and the mean reward of the episodes of the last ``--window`` steps is compared
with that of the first ``--window`` steps; the standard error of each window mean is the episodes' standard
deviation over the square root of their number.

Pass: the normal run rises by more than ``--sigmas`` standard errors and by at least ``--margin``, and the flipped
run does not (its difference stays below the same bar). Exit status 0 on pass, 1 on fail.

Under the reward, the mechanism: each episode's first call is classified by the recipe's warm-start decoys as the
right one, a decoy, or neither, and the share of right first calls is printed per step. Two comparison figures
(both runs, ± one standard error): ``<out>/reward_normal_vs_flipped.png`` (mean episode reward per step) and
``<out>/right_first_call_normal_vs_flipped.png`` (share of right first calls per step); the numbers are in
``<out>/learning_check.json``.

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

from seal.launch import compose_recipe  # noqa: E402
from seal.report.figures import reward_over_steps  # noqa: E402

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


def rollout_rows(run_dir: Path) -> dict[int, list[dict]]:
    """{step: [the dumped row of each training episode of that step]} from the run's rollout dump."""
    steps = {}
    for path in (run_dir / "rollout_log").glob("*.jsonl"):
        with open(path) as f:
            steps[int(path.stem)] = [json.loads(line) for line in f if line.strip()]
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


def recipe_decoys(recipe: str) -> dict[str, list[str]]:
    """The recipe's warm-start decoys: ``{task: [old, new, ...]}``."""
    return dict(compose_recipe(str(ROOT / recipe)).seal.tiny_model.warm_start.get("decoys") or {})


def choice_roles(decoys: dict[str, list[str]]) -> dict[str, str]:
    """{text: "right" | "decoy"} for the texts of warm-start decoys (``{task: [old, new, ...]}``): the first
    ground-truth call's text is right, its replacements are decoys."""
    roles: dict[str, str] = {}
    for task, (right, *wrong) in decoys.items():
        for text, role in ((right, "right"), *((w, "decoy") for w in wrong)):
            if roles.setdefault(text, role) != role:
                raise SystemExit(f"{text!r} is a right first call and a decoy ({task}): the choice is ambiguous")
    return roles


def first_call_choice(output: str, roles: dict[str, str]) -> str:
    """What an episode's first call chose: "right", "decoy", or "other" (neither: a broken or different call)."""
    first_call = output.split("</tool_call>", 1)[0]
    found = {role for text, role in roles.items() if text in first_call}
    return found.pop() if len(found) == 1 else "other"


def per_step(values: dict[int, list[float]]) -> dict[int, tuple[float, float]]:
    return {step: mean_se(v) for step, v in values.items()}


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
    rows = {name: rollout_rows(out / name) for name in RECIPES}
    series = {name: {s: [float(r["score"]) for r in step] for s, step in steps.items()} for name, steps in rows.items()}
    results = {name: compare(steps, args.window) for name, steps in series.items()}
    # the mechanism under the reward: how often the first call makes the one choice the warm start left open
    right = {}
    for name, steps in rows.items():
        roles = choice_roles(recipe_decoys(RECIPES[name]))
        right[name] = {
            s: [float(first_call_choice(r["output"], roles) == "right") for r in step] for s, step in steps.items()
        }
    reward_stats = {name: per_step(steps) for name, steps in series.items()}
    right_stats = {name: per_step(steps) for name, steps in right.items()}
    figure = reward_over_steps(
        reward_stats,
        str(out / "reward_normal_vs_flipped.png"),
        title="GRPO on CPU: training reward per step (± one standard error)",
    )
    choice_figure = reward_over_steps(
        right_stats,
        str(out / "right_first_call_normal_vs_flipped.png"),
        ylabel="share of right first calls",
        title="the choice the warm start left open (± one standard error)",
    )

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
    for name, stats in right_stats.items():
        print(f"{name:8s} right first call per step: " + " ".join(f"{mean:.2f}" for mean, _ in stats.values()))
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
        "mean_reward_per_step": {name: {s: m for s, (m, _) in stats.items()} for name, stats in reward_stats.items()},
        "right_first_call_per_step": {
            name: {s: m for s, (m, _) in stats.items()} for name, stats in right_stats.items()
        },
        "wall_s": wall,
        "figures": [figure, choice_figure],
    }
    (out / "learning_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"figures: {figure}, {choice_figure}")
    print(
        f"normal rises: {normal_rises}; flipped rises: {flipped_rises} "
        f"(rise = difference > {args.sigmas} SE and >= {args.margin}) -> {'PASS' if verdict else 'FAIL'}"
    )
    return 0 if verdict else 1


if __name__ == "__main__":
    sys.exit(main())
