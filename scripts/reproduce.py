#!/usr/bin/env python
"""Reproduce the paper: print the GPU plan, or rehearse the same chain on CPU.

    python scripts/reproduce.py --plan [--out experiments/paper]
    python scripts/reproduce.py --rehearse [--out experiments/rehearsal] [--rows ROW,ROW] [--steps N]

``--plan`` prints every command of the GPU reproduction in order — the training run of each Table-1 and ablation
row and of SEAL as the paper describes it, ``seal.eval`` of each trained run's best and last checkpoint and of each
base model, the out-of-distribution evaluation of each row of the paper's OOD table, ``make_tables.py`` — with the
table cells each fills and, per training and evaluation, a range of GPU-hours for H100 and A100 80GB GPUs with
what it assumed (listed at the end).

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

from seal.report import reproduction


def step_costs(step: reproduction.Step) -> list[reproduction.Cost]:
    """The estimates for a train or eval step, from the recipe it composes (its switches included): for each GPU
    type, the low and the high end of the range (empty when the model's size is unknown)."""
    if step.kind not in ("train", "eval"):
        return []
    overrides = [a for a in step.argv[step.argv.index(step.recipe) + 1 :] if "=" in a and not a.startswith("-")]
    # the run's names and folders change nothing the estimate reads: rows of one recipe share one composition
    switches = tuple(o for o in overrides if o.partition("=")[0] not in reproduction.RUN_KEYS)
    config = reproduction.composed(step.recipe, switches)
    found = [
        reproduction.cost(config, step.kind, gpu, a) for gpu in reproduction.GPU_TYPES for a in reproduction.ASSUMPTIONS
    ]
    return [c for c in found if c is not None]


def hours(value: float) -> str:
    return f"{value:.{1 if value >= 1 else 2}f}"


def cost_lines(step: reproduction.Step, costs: list[reproduction.Cost]) -> list[str]:
    """Per GPU type the range, and for a training row what it assumed of its own recipe: steps, episodes, the FLOPs
    factor, decode throughput from the KV cache's capacity."""
    first = costs[0]
    lines = []
    if step.kind == "train":
        lines.append(
            f"    {first.steps} steps, {first.train_episodes} training episodes, {first.val_episodes} validation "
            f"episodes; {first.flops_per_parameter} training FLOPs per parameter and token"
        )
    for gpu in reproduction.GPU_TYPES:
        ends = [c for c in costs if c.gpu == gpu]
        low, high = ends[0], ends[-1]
        decode = ", ".join(
            f"{c.assumptions.name}: KV cache {c.decode.kv_tokens:,} tokens holds {c.decode.at_once} of "
            f"{c.decode.sequences} contexts of {c.decode.context:,} -> {c.decode.tokens_per_s:,.0f} tokens/s"
            for c in (low, high)
        )
        lines.append(
            f"    ~{hours(low.gpu_hours)}-{hours(high.gpu_hours)} GPU-hours on {first.gpus} x {gpu.name} "
            f"(decode per replica, {decode})"
        )
    return lines


def print_assumptions() -> None:
    print("The GPU-hour ranges are estimates, not measurements (docs/reproduce.md); their assumptions, low / high:")
    low, high = reproduction.ASSUMPTIONS
    for name in vars(low):
        if name != "name":
            print(f"  {name}: {getattr(low, name)} / {getattr(high, name)}")
    print(
        f"  training FLOPs per parameter and token: {reproduction.TRAIN_FLOPS_PER_PARAMETER} "
        f"(+{reproduction.RECOMPUTE_FLOPS_PER_PARAMETER} with gradient checkpointing)"
    )
    for gpu in reproduction.GPU_TYPES:
        print(
            f"  {gpu.name}: {gpu.peak_flops / 1e12:.0f} TFLOP/s dense bf16, {gpu.bandwidth / 1e12:.2f} TB/s, "
            f"{gpu.memory_gib:.0f} GiB"
        )
    print(
        "  decode: memory-bound; per replica, the contexts the KV cache holds at once (capacity as "
        "`launcher.py --dry-run` prints it) share each step's read of the weights and their KV"
    )


def print_plan(out: str) -> None:
    from seal.units import disk_size

    steps = reproduction.plan(out)
    disks = {row.row: row for row in reproduction.plan_disk(out)}
    totals: dict[tuple[str, str], list[float]] = {}
    print(f"# The paper's reproduction on GPUs: {len(steps)} commands, in order (outputs under {out}/)\n")
    for i, step in enumerate(steps, 1):
        costs = step_costs(step)
        print(f"{i:2d}. [{step.kind}] {step.fills}")
        print(f"    {step.command()}")
        if costs:
            for line in cost_lines(step, costs):
                print(line)
        if step.kind == "train":
            disk = disks[step.row]
            print(
                f"    disk: {disk.disk.describe()} at its peak; keeps {disk_size(disk.kept_bytes)} for its evaluations"
            )
            for c in costs:
                totals.setdefault((c.gpu.name, step.kind), [0.0, 0.0])[
                    c.assumptions is reproduction.ASSUMPTIONS[1]
                ] += c.gpu_hours
    print(
        "\nood: each row of the paper's OOD table (the Qwen backbones; the ToolACE rows fill no OOD cell and are not "
        "evaluated there) with its checkpoint served by vLLM for the command's length (--serve: started, watched and "
        "stopped by seal.eval); USER_ENDPOINT/USER_MODEL: tau2's user simulator (docs/ood.md)."
    )
    for gpu in reproduction.GPU_TYPES:
        parts = [f"{kind} {low:.0f}-{high:.0f}" for (name, kind), (low, high) in totals.items() if name == gpu.name]
        print(f"GPU-hours on {gpu.name}: " + ", ".join(parts) + " (OOD not estimated: about 1-2 GPU-hours a row).")
    print(
        f"Checkpoint disk under {out}/checkpoints: {disk_size(reproduction.whole_disk(list(disks.values())))} at the "
        "peak (every trained row's best and last checkpoint kept for its evaluations, one row in training)."
    )
    print_assumptions()


def print_wall_clock() -> None:
    """Expected wall-clock time per training step and per run of each backbone's SEAL recipe on one node of 1, 2, 4
    and 8 GPUs of each type (the plan's cost model, low-high), as the markdown table docs/recipes.md shows."""
    print("| recipe | GPUs | " + " | ".join(f"{g.name}: step, run" for g in reproduction.GPU_TYPES) + " | memory |")
    print("| --- | --- | " + " | ".join("---" for _ in reproduction.GPU_TYPES) + " | --- |")
    for recipe, _model in reproduction.BACKBONES.values():
        for gpus in reproduction.WALL_CLOCK_GPUS:
            found = [reproduction.wall_clock(recipe, gpus, gpu) for gpu in reproduction.GPU_TYPES]
            cells = [
                f"{w.low.step_s / 60:.1f}-{w.high.step_s / 60:.1f} min, {w.low.wall_s / 3600:.1f}-{w.high.wall_s / 3600:.1f} h"
                for w in found
            ]
            memory = "fits 80 GB" if found[0].fits else "does not fit 80 GB: offload (launcher.py --dry-run)"
            print(f"| `{recipe}` | {gpus} | " + " | ".join(cells) + f" | {memory} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="print the GPU reproduction, step by step")
    mode.add_argument("--rehearse", action="store_true", help="run the same chain on CPU from the paper's recipes")
    mode.add_argument(
        "--wall-clock",
        action="store_true",
        help="print the expected time per step and per run on 1, 2, 4 and 8 GPUs (the plan's estimate)",
    )
    parser.add_argument("--out", help="output folder (default: experiments/paper, experiments/rehearsal)")
    parser.add_argument("--rows", help="comma-separated rows to rehearse (default: all), e.g. qwen2.5-7b__seal")
    parser.add_argument("--steps", type=int, help="training steps per run in a rehearsal (default: the swap's, 1)")
    parser.add_argument("--jobs", type=int, default=1, help="rows rehearsed side by side (each ~4 GB of memory)")
    args = parser.parse_args(argv)
    if args.plan:
        print_plan(args.out or "experiments/paper")
        return 0
    if args.wall_clock:
        print_wall_clock()
        return 0
    known = set(reproduction.rows())
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
