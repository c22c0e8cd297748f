#!/usr/bin/env python
"""The paper's tables from a folder of runs, with the paper's numbers beside ours.

    python scripts/make_tables.py RUNS_DIR [--out tables/] [--step last|best|N] [--row KEY=PATH ...]
                                  [--mcnemar RUN_A RUN_B] [--val-file data/bfcl_heldout.parquet]

Every sub-folder of RUNS_DIR is a run: a training run's ``seal.run_dir`` (``metrics_*.jsonl``, ``validation_log/``)
or an evaluation folder of ``python -m seal.eval`` (``results.jsonl``). Rows are found by folder name:

* Table 1: ``<backbone>__<training>`` with backbone ``qwen2.5-3b`` | ``qwen2.5-7b`` | ``toolace2-8b`` and training
  ``base`` | ``vanilla_rl`` | ``seal`` (e.g. ``qwen2.5-7b__seal``);
* ablation: the recipes' experiment names ``SEAL``, ``wo_env_adaptation``, ``wo_reweighting``, ``wo_closed_loop``;

or given explicitly with ``--row qwen2.5-7b__seal=path/to/run`` / ``--row wo_reweighting=path``. Writes
``table1.md``, ``ablation.md``, ``runs.md`` (every run, ours only), ``tables.json``, ``mcnemar.md`` (each pair of
runs evaluated on the same tasks, or the pairs asked for) and ``accuracy_over_steps.png`` (held-out accuracy per
category over steps for every training run, ± one standard error).

A cell reads ``ours ± se | paper | ours − paper ± se``: the paper's standard error is the binomial one of its
accuracy on 100 tasks per category (400 for the Average), independent of ours. A paper cell that the paper does
not report stays empty.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from seal import paper_numbers as paper  # noqa: E402
from seal.eval.report import TABLE_COLUMNS, Cell, pct  # noqa: E402
from seal.eval.runs import DEFAULT_VAL_FILE, RunResult, load_run  # noqa: E402

BACKBONE_KEYS = {
    "qwen2.5-3b": "Qwen2.5-3B-Instruct",
    "qwen2.5-7b": "Qwen2.5-7B-Instruct",
    "toolace2-8b": "ToolACE-2-Llama-3.1-8B",
}


def table1_key(name: str) -> tuple[str, str] | None:
    backbone, _, training = name.partition("__")
    if backbone in BACKBONE_KEYS and training in paper.TRAININGS:
        return BACKBONE_KEYS[backbone], training
    return None


def paper_cell(value: float | None, column: str) -> Cell | None:
    if value is None:
        return None
    n = paper.TASKS_PER_CATEGORY * (4 if column == "average" else 1)
    p = value / 100
    return Cell(p, math.sqrt(p * (1 - p) / n), n)


def difference(ours: Cell | None, theirs: Cell | None) -> str:
    if ours is None or theirs is None or not ours.n or math.isnan(ours.accuracy):
        return ""
    se = math.sqrt((0 if math.isnan(ours.stderr) else ours.stderr) ** 2 + theirs.stderr**2)
    return f"{100 * (ours.accuracy - theirs.accuracy):+.2f} ± {100 * se:.2f}"


def comparison_table(rows: list[tuple[str, RunResult | None, dict]]) -> str:
    """Rows of (label, our run or None, the paper's numbers): ``ours ± se | paper | diff ± se`` per column."""
    head = "| model | " + " | ".join(f"{t} (ours / paper / diff)" for t in TABLE_COLUMNS.values()) + " |"
    lines = [head, "| --- |" + " --- |" * len(TABLE_COLUMNS)]
    for label, run, numbers in rows:
        cells = []
        for column in TABLE_COLUMNS:
            ours = run.cells.get(column) if run else None
            theirs = paper_cell(numbers.get(column), column)
            paper_text = f"{numbers[column]:.2f}" if numbers.get(column) is not None else ""
            cells.append(f"{pct(ours) or '–'} / {paper_text or '–'} / {difference(ours, theirs) or '–'}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mcnemar(a: dict[str, bool], b: dict[str, bool]) -> dict:
    """Exact two-sided McNemar test on the tasks both runs scored: b01 = only A passed, b10 = only B passed."""
    shared = sorted(set(a) & set(b))
    only_a = sum(a[t] and not b[t] for t in shared)
    only_b = sum(b[t] and not a[t] for t in shared)
    k, n = min(only_a, only_b), only_a + only_b
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"tasks": len(shared), "only_a": only_a, "only_b": only_b, "p_value": p}


def discover(runs_dir: str, explicit: list[str], step: str, val_file: str) -> dict[str, RunResult]:
    paths = {}
    for entry in sorted(os.listdir(runs_dir)):
        full = os.path.join(runs_dir, entry)
        if os.path.isdir(full):
            paths[entry] = full
    for item in explicit:
        key, _, path = item.partition("=")
        paths[key] = path
    runs = {}
    for key, path in paths.items():
        try:
            runs[key] = load_run(path, key, step=step, val_file=val_file)
        except FileNotFoundError as exc:
            print(f"[make_tables] skipped {path}: {exc}", file=sys.stderr)
    return runs


def make_tables(runs: dict[str, RunResult], out_dir: str, pairs: list[tuple[str, str]] | None = None) -> dict:
    from seal.eval.report import markdown_table
    from seal.figures import accuracy_bands

    os.makedirs(out_dir, exist_ok=True)
    by_t1 = {table1_key(k): r for k, r in runs.items() if table1_key(k)}
    t1_rows = [
        (f"{b} {paper.TRAINING_NAMES[t]}", by_t1.get((b, t)), paper.TABLE1[(b, t)])
        for b in paper.BACKBONES
        for t in paper.TRAININGS
    ]
    ab_rows = [(paper.ABLATION_NAMES[k], runs.get(k), numbers) for k, numbers in paper.ABLATION.items()]
    texts = {
        "table1.md": "Table 1 (accuracy %, ours ± standard error / paper / ours − paper ± standard error)\n\n"
        + comparison_table(t1_rows),
        "ablation.md": "Ablation on Qwen2.5-7B-Instruct (the paper reports the Average only)\n\n"
        + comparison_table(ab_rows),
        "runs.md": markdown_table({k: r.cells for k, r in runs.items()}),
    }
    with_verdicts = {k: r for k, r in runs.items() if r.verdicts}
    if pairs is None:
        pairs = [
            (a, b)
            for a, b in itertools.combinations(with_verdicts, 2)
            if set(with_verdicts[a].verdicts) == set(with_verdicts[b].verdicts)
        ]
    tests = {
        f"{a} vs {b}": mcnemar(runs[a].verdicts, runs[b].verdicts)
        for a, b in pairs
        if a in with_verdicts and b in with_verdicts
    }
    lines = [
        "| A vs B | tasks | only A passed | only B passed | p (exact McNemar) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {k} | {v['tasks']} | {v['only_a']} | {v['only_b']} | {v['p_value']:.4g} |" for k, v in tests.items()]
    texts["mcnemar.md"] = "\n".join(lines) + "\n"
    for name, text in texts.items():
        Path(out_dir, name).write_text(text)
    summary = {
        "runs": {
            k: {"path": r.path, "step": r.step, "cells": {c: vars(v) for c, v in r.cells.items()}}
            for k, r in runs.items()
        },
        "mcnemar": tests,
    }
    Path(out_dir, "tables.json").write_text(json.dumps(summary, indent=1))
    figure = accuracy_bands(
        {k: r.history for k, r in runs.items() if r.history}, os.path.join(out_dir, "accuracy_over_steps.png")
    )
    if figure:
        summary["figure"] = figure
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir")
    parser.add_argument("--out", default="tables")
    parser.add_argument("--step", default="last", help="which validation of a training run: last, best or a step")
    parser.add_argument("--row", action="append", default=[], help="KEY=PATH: a run for a row (see above)")
    parser.add_argument(
        "--mcnemar",
        nargs=2,
        action="append",
        metavar=("RUN_A", "RUN_B"),
        help="a pair of runs to test (default: every pair scored on the same tasks)",
    )
    parser.add_argument(
        "--val-file",
        default=DEFAULT_VAL_FILE,
        help="the training runs' data.val_files (row order of their validation dumps)",
    )
    args = parser.parse_args(argv)
    runs = discover(args.runs_dir, args.row, args.step, args.val_file)
    if not runs:
        print(f"[make_tables] no runs in {args.runs_dir}", file=sys.stderr)
        return 1
    make_tables(runs, args.out, [tuple(p) for p in args.mcnemar] if args.mcnemar else None)
    for name in ("table1.md", "ablation.md", "runs.md", "mcnemar.md"):
        print(Path(args.out, name).read_text())
    print(
        f"[make_tables] wrote {args.out}/: table1.md, ablation.md, runs.md, mcnemar.md, tables.json"
        + (", accuracy_over_steps.png" if any(r.history for r in runs.values()) else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
