#!/usr/bin/env python
"""Reproduce the paper: print the GPU plan, or rehearse the same chain on CPU.

    python scripts/reproduce.py --plan [--out experiments/paper]
    python scripts/reproduce.py --rehearse [--out experiments/rehearsal] [--rows ROW,ROW] [--steps N]

``--plan`` prints every command of the GPU reproduction in order — the training run of each Table-1 and ablation
row, ``seal.eval`` of each trained checkpoint and base model, the out-of-distribution evaluation of each Table-1
row, ``make_tables.py`` — with the table cells each fills and its estimated GPU-hours.

``--rehearse`` runs that chain on this machine from the same recipes, with only what a CPU machine cannot run
swapped (``seal/config/swap/cpu.yaml``; the base models become the untrained tiny model, a stub endpoint stands in
for the served checkpoints, the out-of-distribution categories are the ones that run offline). It ends in
``OUT/tables/`` (Table 1, the ablation, the OOD table, ``accuracy_over_steps.png``) and each training run's figures
under ``OUT/runs/<row>__training/``; every command's output is in ``OUT/logs/``. ``--rows`` rehearses some rows
only; ``--steps`` trains more than one step (a key of the swap).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from seal.report import reproduction  # noqa: E402


def step_cost(step: reproduction.Step) -> reproduction.Cost | None:
    """The estimate for a train or eval step, from the recipe it composes (its switches included)."""
    from seal.launch import compose_recipe

    if step.kind not in ("train", "eval"):
        return None
    overrides = [a for a in step.argv[step.argv.index(step.recipe) + 1 :] if "=" in a and not a.startswith("-")]
    config = compose_recipe(str(ROOT / step.recipe), overrides)
    return reproduction.cost(config, step.kind)


def print_plan(out: str) -> None:
    steps = reproduction.plan(out)
    totals: dict[str, float] = {}
    print(f"# The paper's reproduction on GPUs: {len(steps)} commands, in order (outputs under {out}/)\n")
    for i, step in enumerate(steps, 1):
        found = step_cost(step)
        print(f"{i:2d}. [{step.kind}] {step.fills}")
        print(f"    {step.command()}")
        if found is not None:
            what = f"{found.steps} steps, {found.train_episodes} training episodes, " if step.kind == "train" else ""
            print(
                f"    ~{found.gpu_hours:.{1 if found.gpu_hours >= 1 else 2}f} GPU-hours on {found.gpus} GPU(s) ({what}{found.val_episodes} validation episodes)"
            )
            totals[step.kind] = totals.get(step.kind, 0.0) + found.gpu_hours
    print(
        "\nserve / ood: one vLLM server per Table-1 row; USER_ENDPOINT/USER_MODEL: tau2's user simulator (docs/ood.md)."
    )
    print(
        "GPU-hours are estimates from each recipe's sizes (steps, tasks, rollouts, max_model_len) and the assumptions "
        "in seal/report/reproduction.py (docs/reproduce.md), not measurements: "
        + ", ".join(f"{kind} {hours:.0f}" for kind, hours in totals.items())
        + f", in all {sum(totals.values()):.0f} (OOD not estimated: about 1-2 GPU-hours a row, mostly tau2)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="print the GPU reproduction, step by step")
    mode.add_argument("--rehearse", action="store_true", help="run the same chain on CPU from the paper's recipes")
    parser.add_argument("--out", help="output folder (default: experiments/paper, experiments/rehearsal)")
    parser.add_argument("--rows", help="comma-separated rows to rehearse (default: all), e.g. qwen2.5-7b__seal")
    parser.add_argument("--steps", type=int, help="training steps per run in a rehearsal (default: the swap's, 1)")
    parser.add_argument("--jobs", type=int, default=1, help="rows rehearsed side by side (each ~4 GB of memory)")
    args = parser.parse_args(argv)
    if args.plan:
        print_plan(args.out or "experiments/paper")
        return 0
    known = {step.row for step in reproduction.plan()} - {""}
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
    unknown = sorted(set(rows or ()) - known)
    if unknown:
        print(f"[reproduce] error: unknown rows {unknown}; the rows are {sorted(known)}", file=sys.stderr)
        return 2
    out = args.out or "experiments/rehearsal"
    status = reproduction.run_rehearsal(out, rows, args.steps, args.jobs)
    if status == 0:
        tables = os.path.join(out, "tables")
        print(
            f"[reproduce] done: tables and accuracy_over_steps.png in {tables}/, run figures in {out}/runs/*__training/"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
