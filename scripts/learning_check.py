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

``--apatch-steering`` runs another pair instead, per rollout seed (``--seeds``): exp/cpu_learning_apatch.yaml, whose
open first call has two decoys that the environment tags differently and A-Patch weighs 2.0 and 0.75, with A-Patch
on and off (exp/cpu_learning_apatch_off.yaml), and decides by the rule pre-registered in docs/learning-check.md
whether the heavily weighted decoy is unlearnt faster when A-Patch is on. The figure
``<out>/apatch_steering_decoy_shares.png`` shows each decoy's share per step, on vs off; the numbers are in
``<out>/apatch_steering.json``.

    python scripts/learning_check.py --apatch-steering --out experiments/apatch_steering

``--apatch-exact`` measures the tag weight's effect on the policy exactly, in-process (``scripts/apatch_exact.py``:
A-Patch on, off and swapped, teacher-forced log-probabilities after 1 and 3 updates; ``--pilot`` for the pilot
seeds); ``--apatch-live`` runs the same arms through the launcher and computes the metric from each step's weights
(docs/learning-check.md, Stage A and Stage B). ``--apatch-sampled`` (Stage C, ``scripts/apatch_sampled.py``) runs
A-Patch on, neutral, swapped, off and its controls on batches the policy samples from itself, from a shared trunk,
and decides by the registered paired t tests; its exit status follows the rule.

    python scripts/learning_check.py --apatch-exact --pilot --out experiments/apatch_exact_pilot
    python scripts/learning_check.py --apatch-exact --out experiments/apatch_exact
    python scripts/learning_check.py --apatch-live --out experiments/apatch_live
    python scripts/learning_check.py --apatch-sampled --pilot --out experiments/apatch_sampled_pilot
    python scripts/learning_check.py --apatch-sampled --out experiments/apatch_sampled
    python scripts/learning_check.py --apatch-live --trunk --out experiments/apatch_live_trunk
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from seal.report.decoy_choice import (
    FirstChoice,
    choice_roles,
    first_call_choice,
    first_message,
    mean_se,
    recipe_decoys,
)
from seal.results.figures import reward_over_steps

ROOT = Path(__file__).resolve().parents[1]

RECIPES = {"normal": "exp/cpu_learning.yaml", "flipped": "exp/cpu_learning_flipped.yaml"}
# --apatch-steering: the same run with A-Patch on and off (its own switch, nothing else changed), per rollout seed
STEERING_RECIPES = {"on": "exp/cpu_learning_apatch.yaml", "off": "exp/cpu_learning_apatch_off.yaml"}
STEERING_SEEDS = (42, 1, 2)


def run(name: str, out: Path, extra: list[str], recipe: str | None = None) -> float:
    """One launcher run of ``recipe`` (default ``RECIPES[name]``) into ``out/name``; returns its wall time in
    seconds."""
    run_dir = out / name
    log = out / f"{name}.log"
    cmd = [
        sys.executable,
        str(ROOT / "launcher.py"),
        "--conf",
        str(ROOT / (recipe or RECIPES[name])),
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


def per_step(values: dict[int, list[float]]) -> dict[int, tuple[float, float]]:
    return {step: mean_se(v) for step, v in values.items()}


# ---- --apatch-steering: does A-Patch steer what is unlearnt? -------------------------------------------------


def option_of(output: str, options: dict[str, dict], choice: FirstChoice) -> str:
    """The option whose tags the episode's first message earns (with the rest of the episode right), or "other":
    what A-Patch weighs is the tags, so a first message that differs from an option's text only where the
    environment does not look (say a second, read-only call) counts as that option."""
    tags = list(choice.tags(first_message(output)))
    return next((name for name, option in options.items() if option["tags"] == tags), "other")


def option_counts(rows: dict[int, list[dict]], options: dict[str, dict], choice: FirstChoice) -> dict[int, dict]:
    """{step: {option: episodes that chose it}} ("other" included)."""
    counts = {}
    for step, episodes in rows.items():
        chosen = [option_of(r["output"], options, choice) for r in episodes]
        counts[step] = {name: chosen.count(name) for name in (*options, "other")}
    return counts


def log_ratio_change(counts: dict[int, dict[str, int]]) -> float:
    """How far log(heavy / light) moved from the first step (the warm start's own choices: no update yet) to the
    later steps, their episodes pooled; half an episode is added to each count (a decoy may not be drawn at all).
    Pooling the later steps rather than comparing end windows: the decoys are unlearnt within a few steps, after
    which a window holds too few of them to compare."""
    if len(counts) < 2:
        raise SystemExit(f"only {len(counts)} steps logged; need at least 2")
    first, *later = sorted(counts)

    def log_ratio(steps):
        heavy = sum(counts[s]["heavy"] for s in steps) + 0.5
        light = sum(counts[s]["light"] for s in steps) + 0.5
        return math.log(heavy / light)

    return log_ratio(later) - log_ratio([first])


def steering_verdict(counts: dict[int, dict[str, dict]], sigmas: float) -> dict:
    """The pre-registered rule (docs/learning-check.md): per seed, the log-ratio change with A-Patch on minus that
    with A-Patch off; passes when the mean of these paired differences is negative (the heavy decoy falls faster
    when A-Patch weighs it) by more than ``sigmas`` standard errors across seeds. ``counts[seed][on|off]``."""
    per_seed = {}
    for seed, runs in counts.items():
        on, off = (log_ratio_change(runs[mode]) for mode in ("on", "off"))
        per_seed[seed] = {"on": on, "off": off, "paired": on - off}
    paired = [r["paired"] for r in per_seed.values()]
    if len(paired) < 2:  # no standard error across seeds: the numbers, but no verdict
        return {"per_seed": per_seed, "paired_mean": paired[0], "paired_se": None, "passed": None}
    mean, se = mean_se(paired)
    return {"per_seed": per_seed, "paired_mean": mean, "paired_se": se, "passed": -mean > sigmas * se}


def shares_per_step(counts: dict[int, dict[str, int]], option: str) -> dict[int, list[float]]:
    """{step: [1.0 for each episode that chose ``option``, else 0.0]}."""
    return {s: [1.0] * c[option] + [0.0] * (sum(c.values()) - c[option]) for s, c in counts.items()}


def steering(args) -> int:
    out = Path(args.out).resolve()
    choice = FirstChoice(STEERING_RECIPES["on"])
    options = choice.options()
    for name, option in options.items():
        print(f"{name:6s} tags {option['tags']} scale {option['scale']:.2f}: {option['text']!r}")
    counts, wall = {}, {}
    for seed in args.seeds:
        seed_dir = out / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        for mode, recipe in STEERING_RECIPES.items():
            if not args.reuse:
                extra = [*args.overrides, f"actor_rollout_ref.rollout.seed={seed}"]
                wall[f"{seed}/{mode}"] = run(mode, seed_dir, extra, recipe)
        counts[seed] = {
            mode: option_counts(rollout_rows(seed_dir / mode), options, choice) for mode in STEERING_RECIPES
        }
    verdict = steering_verdict(counts, args.sigmas)

    for seed, runs in counts.items():
        for mode, steps in runs.items():
            line = " ".join(f"{c['right']:2d}/{c['heavy']:2d}/{c['light']:2d}" for c in steps.values())
            print(f"seed {seed:>3} A-Patch {mode:3s} right/heavy/light per step: {line}")
        r = verdict["per_seed"][seed]
        print(
            f"seed {seed:>3} log(heavy/light) change: on {r['on']:+.2f}  off {r['off']:+.2f}  on-off {r['paired']:+.2f}"
        )
    if verdict["passed"] is None:
        print(
            f"paired on-off {verdict['paired_mean']:+.2f}: one seed, no verdict (the rule needs a spread across seeds)"
        )
    else:
        print(
            f"paired on-off mean {verdict['paired_mean']:+.2f} ± {verdict['paired_se']:.2f} over {len(counts)} seeds "
            f"(pass: below -{args.sigmas} SE) -> {'PASS' if verdict['passed'] else 'FAIL'}"
        )
    pooled = {
        f"{option} decoy, A-Patch {mode}": per_step(
            {
                s: [v for seed in counts for v in shares_per_step(counts[seed][mode], option)[s]]
                for s in counts[args.seeds[0]][mode]
            }
        )
        for option in ("heavy", "light")
        for mode in STEERING_RECIPES
    }
    figure = reward_over_steps(
        pooled,
        str(out / "apatch_steering_decoy_shares.png"),
        ylabel="share of episodes",
        title=f"each decoy's share per step, A-Patch on vs off ({len(counts)} seeds pooled, ± one SE)",
    )
    summary = {
        "options": options,
        "sigmas": args.sigmas,
        "counts": counts,
        "verdict": verdict,
        "wall_s": wall,
        "figure": figure,
    }
    (out / "apatch_steering.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"figure: {figure}")
    return 0 if verdict["passed"] else 1


# ---- --apatch-exact: Stage A, what a tag weight does to the policy, measured exactly --------------------------


def exact(args) -> int:
    """Stage A (``scripts/apatch_exact.py``): per batch seed, every condition's arms after 1 and 3 updates. The
    results go to ``<out>/apatch_exact.json`` seed by seed (``--reuse`` analyses them without running)."""
    import apatch_exact as ax

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "apatch_exact.json"
    seeds = args.seeds or list(ax.PILOT_SEEDS if args.pilot else ax.REGISTERED_SEEDS)
    saved = json.loads(path.read_text()) if path.exists() else {"seeds": {}}
    model, tokenizer = ax.warm_model()
    candidates = ax.load_candidates(tokenizer, model.config.model_type)
    probabilities = ax.candidate_probabilities(model, candidates)
    ratio = max(probabilities.values()) / min(probabilities.values())
    for name, c in candidates.items():
        print(f"{name:6s} p {probabilities[name]:.3f}  tags {c.evaluation['tags']}  scale {c.scale:.2f}: {c.text!r}")
    print(
        f"max/min probability {ratio:.2f} (comparable: within 2); other first messages {1 - sum(probabilities.values()):.3f}"
    )
    if ratio > 2:
        raise SystemExit("the warm start left the candidates more than a factor of 2 apart")
    conds = ax.conditions(model.config.hidden_size)
    saved |= {
        "probabilities": probabilities,
        "conditions": {name: dataclasses.asdict(c) for name, c in conds.items()},
        "batch_shape": ax.batch_shape(),
    }
    begin = None
    for seed in seeds:
        if str(seed) not in saved["seeds"] or not args.reuse:
            start = time.perf_counter()
            begin = begin or ax.starts(model, candidates, probabilities)
            saved["seeds"][str(seed)] = ax.run_seed(model, begin, candidates, probabilities, seed, conds)
            saved["seeds"][str(seed)]["wall_s"] = time.perf_counter() - start
            path.write_text(json.dumps(saved, indent=2) + "\n")
        print("\n".join(ax.seed_lines(seed, saved["seeds"][str(seed)])), flush=True)
    results = {seed: saved["seeds"][str(seed)] for seed in seeds}
    for line in ax.summary_lines(results):
        print(line)
    if args.pilot:
        lines, n = ax.power_lines(results)
        print("\n".join(lines))
        saved["power"] = {"lines": lines, "seeds": n}
        path.write_text(json.dumps(saved, indent=2) + "\n")
        return 0
    verdict = ax.verdict(results)
    saved["verdict"] = verdict
    path.write_text(json.dumps(saved, indent=2) + "\n")
    for line in ax.verdict_lines(verdict):
        print(line)
    return 0 if verdict["survives_adamw"] else 1


# ---- --apatch-live: Stage B, the live check with the candidates' exact log-probabilities every step -------------

#: Stage B's design (docs/learning-check.md, registered before its runs): the exact recipe with A-Patch on, off
#: (its own switch) and swapped (the decoys' tag weights exchanged), paired by rollout seed, through the launcher;
#: every step's weights saved in Hugging Face form, so that the candidates' log-probabilities are exact as in Stage A.
LIVE_RECIPE = "exp/cpu_learning_apatch_exact.yaml"
LIVE_SEEDS = (42, 1)
LIVE_OVERRIDES = (
    "actor_rollout_ref.actor.optim.lr=2.8e-5",  # Stage A's analogue of the released 1e-6
    "actor_rollout_ref.actor.optim.weight_decay=0.01",  # the released optimizer and loss aggregation
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.rollout.temperature=1.0",  # the released temperature, Stage A's log-probabilities
    "trainer.save_freq=1",  # every step's weights (the checkpoint's huggingface/ folder) ...
    "seal.checkpoint.keep_only_best=false",  # ... all kept
)
LIVE_STEPS = 6
LIVE_ARMS = ("on", "off", "swapped")
#: Stage C's live replication (``--apatch-live --trunk``, registered before its runs in docs/learning-check.md):
#: Stage C's trunk and arms through the launcher. The trunk (A-Patch off) saves every step with its optimizer state;
#: each arm resumes from a copy of it (verl's resume: weights, AdamW, data position; seal's: the capability state)
#: and trains on, its sampling seeds those of the steps after the trunk's (``seal.rollout.step_seeds``).
REPLICATION_SEEDS = (4101, 4102)
REPLICATION_TRUNK = 10
REPLICATION_ARMS = ("on", "neutral", "swapped", "off")


def checkpoint_logprobs(checkpoints: Path, candidates: dict) -> dict[int, dict[str, float]]:
    """``{step: {candidate: log pi(its first message)}}`` from every step's saved weights (``global_step_N/actor/
    huggingface``), teacher-forced as in Stage A."""
    import apatch_exact as ax
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for step_dir in sorted(checkpoints.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])):
        model = AutoModelForCausalLM.from_pretrained(step_dir / "actor" / "huggingface", dtype=torch.float32)
        with torch.no_grad():
            logprobs = ax.candidate_logprobs(model, candidates)
        out[int(step_dir.name.rsplit("_", 1)[1])] = {
            name: ax.first_message_logprob(logprobs, c) for name, c in candidates.items()
        }
    return out


def live(args) -> int:
    """Stage B: per rollout seed, the live runs of each arm; M = log pi(heavy) - log pi(light) exactly at every step
    (step 0: the warm start), the options the episodes chose, the paired differences; the registered rule
    (docs/learning-check.md). ``<out>/apatch_live.json``."""
    import apatch_exact as ax
    import torch

    out = Path(args.out).resolve()
    seeds = args.seeds or list(REPLICATION_SEEDS if args.trunk else LIVE_SEEDS)
    model, tokenizer = ax.warm_model(LIVE_RECIPE)
    candidates = ax.load_candidates(tokenizer, model.config.model_type, LIVE_RECIPE)
    arms = ax.arm_overrides(candidates, LIVE_RECIPE)
    with torch.no_grad():
        logprobs = ax.candidate_logprobs(model, candidates)
    start = {name: ax.first_message_logprob(logprobs, c) for name, c in candidates.items()}
    choice = FirstChoice(LIVE_RECIPE)
    options = choice.options()
    results, wall = {}, {}
    trunk = REPLICATION_TRUNK if args.trunk else 0
    for seed in seeds:
        seed_dir = out / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        results[seed] = {}
        common = [*LIVE_OVERRIDES, f"actor_rollout_ref.rollout.seed={seed}", *args.overrides]
        if trunk and not args.reuse:
            off = [*common, *arms["off"], f"trainer.total_training_steps={trunk}"]
            wall[f"{seed}/trunk"] = run("trunk", seed_dir, off, LIVE_RECIPE)
        for arm in REPLICATION_ARMS if trunk else LIVE_ARMS:
            extra = [*common, *arms[arm], f"trainer.total_training_steps={trunk + LIVE_STEPS}"]
            checkpoints = seed_dir / "checkpoints" / arm
            if not args.reuse:
                if trunk:  # the arm resumes from the trunk's last step: a copy of its checkpoints is the arm's own
                    shutil.rmtree(checkpoints, ignore_errors=True)
                    shutil.copytree(seed_dir / "checkpoints" / "trunk", checkpoints)
                wall[f"{seed}/{arm}"] = run(arm, seed_dir, extra, LIVE_RECIPE)
            per_step = {0: start} | checkpoint_logprobs(checkpoints, candidates)
            results[seed][arm] = {
                "logprobs": per_step,
                "metric": {t: lp["heavy"] - lp["light"] for t, lp in per_step.items()},
                "options": option_counts(rollout_rows(seed_dir / arm), options, choice),
            }
    verdict = live_verdict(results, trunk)
    summary = {"overrides": LIVE_OVERRIDES, "trunk": trunk, "seeds": results, "wall_s": wall, "verdict": verdict}
    out.mkdir(parents=True, exist_ok=True)
    (out / "apatch_live.json").write_text(json.dumps(summary, indent=2) + "\n")
    for seed, runs in results.items():
        for arm, r in runs.items():
            counts = " ".join(f"{c['right']}/{c['heavy']}/{c['light']}/{c['other']}" for c in r["options"].values())
            print(f"seed {seed:>3} A-Patch {arm:7s} right/heavy/light/other per step: {counts}")
            print(f"{'':12s}M per step: " + " ".join(f"{m:+.4f}" for m in r["metric"].values()))
        for contrast, d in verdict["paired"][seed].items():
            print(f"seed {seed:>3} {contrast} per step: " + " ".join(f"{x:+.4f}" for x in d.values()))
    for contrast, below in verdict["below"].items():
        print(f"{contrast} after the last step below 0 in {below}/{len(results)} seeds")
    decides = " and ".join(verdict["decides"])
    print(f"registered: {decides} below 0 in every seed -> {'PASS' if verdict['passed'] else 'FAIL'}")
    return 0 if verdict["passed"] else 1


def live_verdict(results: dict, trunk: int = 0) -> dict:
    """The registered rules. Stage B (no trunk): A-Patch on leaves log pi(heavy) - log pi(light) lower than the
    swapped weights do after the last step, in every seed (on and swapped weigh every other episode alike). The
    replication (a trunk): on - neutral and on - swapped below 0 after the last step in every seed, a description
    (two seeds have no power for a test; Stage C's in-process run carries the verdict). The other differences from
    ``on`` are reported."""
    paired = {}
    for seed, runs in results.items():
        paired[seed] = {}
        for other in (arm for arm in ("neutral", "swapped", "off") if arm in runs):
            a, b = runs["on"]["metric"], runs[other]["metric"]
            paired[seed][f"on-{other}"] = {t: a[t] - b[t] for t in a if t in b}
    contrasts = next(iter(paired.values()))
    below = {c: sum(d[c][max(d[c])] < 0 for d in paired.values()) for c in contrasts}
    decides = ["on-neutral", "on-swapped"] if trunk else ["on-swapped"]
    return {
        "paired": paired,
        "below": below,
        "decides": decides,
        "passed": all(below[c] == len(paired) for c in decides),
    }


# ---- --apatch-sampled: Stage C, the arms with the policy sampling its own batches, in-process ----------------


def sampled(args) -> int:
    """Stage C (``scripts/apatch_sampled.py``): per seed, the trunk and every condition's arms, each arm's M per step;
    the registered contrasts' tests and verdict (the pilot: the power computation instead). ``<out>/apatch_sampled.json``
    holds every seed as it finishes (``--reuse`` analyses them without running)."""
    import copy

    import apatch_exact as ax
    import apatch_sampled as sx

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "apatch_sampled.json"
    seeds = args.seeds or list(sx.PILOT_SEEDS if args.pilot else sx.REGISTERED_SEEDS)
    if not seeds:
        raise SystemExit("no registered seeds yet: run the pilot (--pilot) and register them (docs/learning-check.md)")
    saved = json.loads(path.read_text()) if path.exists() else {"seeds": {}}
    design = {
        "lr": sx.LIVE_LR, "trunk_updates": args.trunk_updates, "arm_updates": args.arm_updates,
        "batch_shape": ax.batch_shape(), "conditions": sx.CONDITIONS,
    }  # fmt: skip
    design = json.loads(json.dumps(design))  # as the file holds it (tuples are lists)
    if args.reuse and saved.get("design", design) != design:
        raise SystemExit(f"{path} holds seeds of another design ({saved['design']}), not {design}: use another --out")
    saved["design"] = design
    model = None
    for seed in seeds:
        if str(seed) not in saved["seeds"] or not args.reuse:
            if model is None:  # only when a seed runs: --reuse of finished seeds needs no model
                model, tokenizer = ax.warm_model()
                candidates = ax.load_candidates(tokenizer, model.config.model_type)
                reference = copy.deepcopy(model).eval()
                fresh = ax.Start({k: v.detach().clone() for k, v in model.state_dict().items()})
                pool = sx.EpisodePool(candidates, tokenizer, model.config.model_type)
            start = time.perf_counter()
            result = sx.run_seed(model, reference, fresh, pool, seed, args.trunk_updates, args.arm_updates)
            saved["seeds"][str(seed)] = result | {"wall_s": time.perf_counter() - start}
            path.write_text(json.dumps(saved, indent=2) + "\n")
        print("\n".join(sx.seed_lines(seed, saved["seeds"][str(seed)])), flush=True)
    results = {seed: saved["seeds"][str(seed)] for seed in seeds}
    if args.pilot:
        lines, n = sx.power_lines(results)
        saved["power"] = {"lines": lines, "seeds": n}
    verdict = sx.verdict(results)
    saved["verdict"] = verdict
    saved["figures"] = sx.contrast_figures(results, out) if len(results) >= 2 else []
    path.write_text(json.dumps(saved, indent=2) + "\n")
    print("\n".join(sx.verdict_lines(verdict)))
    print("figures: " + ", ".join(saved["figures"]))
    if args.pilot:
        print("\n".join(lines))
        return 0
    return 0 if verdict["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/learning_check", help="where both runs and the figure go")
    parser.add_argument("--window", type=int, default=3, help="steps at the start and at the end to compare")
    parser.add_argument("--sigmas", type=float, default=2.0, help="a rise must exceed this many standard errors")
    parser.add_argument("--margin", type=float, default=0.15, help="and be at least this much reward")
    parser.add_argument("--reuse", action="store_true", help="only analyse runs already in --out")
    parser.add_argument(
        "--apatch-steering",
        action="store_true",
        help="instead: exp/cpu_learning_apatch.yaml with A-Patch on and off, per --seeds (docs/learning-check.md)",
    )
    parser.add_argument(
        "--apatch-exact",
        action="store_true",
        help="instead: Stage A, the A-Patch arms measured exactly in-process, per --seeds (scripts/apatch_exact.py)",
    )
    parser.add_argument(
        "--pilot", action="store_true", help="with --apatch-exact or --apatch-sampled: the pilot's seeds"
    )
    parser.add_argument(
        "--apatch-live",
        action="store_true",
        help="instead: Stage B, the live on/off/swapped runs with exact log-probabilities per step, per --seeds",
    )
    parser.add_argument(
        "--trunk",
        action="store_true",
        help="with --apatch-live: Stage C's live replication (a trunk with A-Patch off, each arm resumed from it)",
    )
    parser.add_argument(
        "--apatch-sampled",
        action="store_true",
        help="instead: Stage C, the A-Patch arms on batches the policy samples itself, in-process, per --seeds",
    )
    parser.add_argument("--trunk-updates", type=int, default=None, help="with --apatch-sampled: the trunk's steps")
    parser.add_argument("--arm-updates", type=int, default=None, help="with --apatch-sampled: each arm's steps")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="rollout seeds (steering: 42 1 2; live: 42 1) or batch seeds (exact)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args(argv)
    if args.trunk and not args.apatch_live:
        parser.error("--trunk is a choice of --apatch-live")
    if (args.trunk_updates is not None or args.arm_updates is not None) and not args.apatch_sampled:
        parser.error("--trunk-updates and --arm-updates are choices of --apatch-sampled")
    if args.apatch_steering:
        args.seeds = args.seeds or list(STEERING_SEEDS)
        return steering(args)
    if args.apatch_exact:
        return exact(args)
    if args.apatch_live:
        return live(args)
    if args.apatch_sampled:
        import apatch_sampled as sx

        args.trunk_updates = sx.TRUNK_UPDATES if args.trunk_updates is None else args.trunk_updates
        args.arm_updates = sx.ARM_UPDATES if args.arm_updates is None else args.arm_updates
        return sampled(args)
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
