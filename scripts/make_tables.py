#!/usr/bin/env python
"""The paper's tables from a folder of runs, with the paper's numbers beside ours.

    python scripts/make_tables.py RUNS_DIR [--out tables/] [--step last|best|N] [--row KEY=PATH ...]
                                  [--mcnemar RUN_A RUN_B] [--val-file data/bfcl_heldout.parquet]

Every sub-folder of RUNS_DIR is a run: a training run's ``seal.run_dir`` (``metrics_*.jsonl``, ``validation_log/``)
or an evaluation folder of ``python -m seal.eval`` (``results.jsonl``). Rows are found by folder name:

* Table 1: ``<backbone>__<training>`` with backbone ``qwen2.5-3b`` | ``qwen2.5-7b`` | ``toolace2-8b`` and training
  ``base`` | ``vanilla_rl`` | ``seal`` (e.g. ``qwen2.5-7b__seal``);
* the OOD table: the same names, from the out-of-distribution records of that folder's ``results.jsonl`` or of
  ``<row>__ood`` (e.g. ``qwen2.5-7b__seal__ood``, an evaluation folder beside a training run);
* ablation (the paper's Table 3): the recipes' experiment names ``SEAL``, ``wo_env_adaptation``, ``wo_reweighting``,
  ``wo_closed_loop``, ``vanilla_rl`` (full SEAL and Vanilla RL fall back to Table 1's ``qwen2.5-7b__seal`` /
  ``__vanilla_rl``);
* a trained row's last checkpoint: ``<row>__last`` beside ``<row>`` (its best checkpoint), e.g.
  ``qwen2.5-7b__seal__last``; both are shown, the best compared with the paper, the last (unbiased) not;
* Table 1's extra row ``qwen2.5-7b__seal_paper_method``: SEAL as the paper describes it, with no paper cell;

or given explicitly with ``--row qwen2.5-7b__seal=path/to/run`` / ``--row wo_reweighting=path``. Paths are
relative to the working directory; the default ``--val-file`` is the repository's. Writes ``table1.md`` (with the
paper's reference models), ``ablation.md``, ``ood.md``, ``interaction.md`` (the ablation's factorial interaction:
the paper's stated figure, the one its cells imply, ours), ``runs.md`` (every run, ours only; runs that could not
be read, and why), ``tables.json``, ``mcnemar.md`` (each pair of evaluations on the same tasks, a trained row by its
last checkpoint where it has one and never a ``__training`` run, or the pairs asked for; p adjusted by Holm for the
pairs reported) and ``accuracy_over_steps.png`` (held-out accuracy per category over steps for every training run,
± one standard error).

A cell reads ``ours ± se | paper | ours − paper ± se``: the paper's standard error is the binomial one of its
accuracy on its task counts (100 per category; ``seal.paper_numbers.OOD_TASKS``), independent of ours. A small
sample (ours or the paper's) shows its 95 % Wilson interval instead of ``± se``, and its Wilson half-width / z is its
SE in a difference; a mean of categories of unequal size shows ``± se`` around the mean it prints. A column our run covers only partly (an Average
without all its categories) says so and is not compared. A paper cell the paper does not report stays empty.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

from seal import paper_numbers as paper
from seal.results.runs import DEFAULT_VAL_FILE, RunResult, load_run
from seal.results.tables import (
    EVAL_OOD_CATEGORIES,
    TABLE_COLUMNS,
    Z95,
    Cell,
    honest_stderr,
    pct,
    pooled_cell,
)

ROOT = Path(__file__).resolve().parents[1]
BACKBONE_KEYS = {
    "qwen2.5-3b": "Qwen2.5-3B-Instruct",
    "qwen2.5-7b": "Qwen2.5-7B-Instruct",
    "toolace2-8b": "ToolACE-2-Llama-3.1-8B",
}
ROW_KEYS = {name: key for key, name in BACKBONE_KEYS.items()}
#: Where an OOD row's results may sit instead of the Table 1 row's own folder.
OOD_SUFFIX = "__ood"
#: A trained row's folder holds its best checkpoint's evaluation (selected on the tasks it is scored on: the paper's
#: protocol); ``<row>__last`` its last checkpoint's (selected by nothing: the unbiased score).
LAST_SUFFIX = "__last"
CHECKPOINT_LABELS = {"": "best checkpoint", LAST_SUFFIX: "last checkpoint, unbiased"}
#: Training runs (``seal.run_dir``): their validations are in the tables' figure and runs.md, not in McNemar's
#: default pairs (the evaluations of their checkpoints are).
TRAINING_SUFFIX = "__training"
#: The extra row of Table 1: SEAL as the paper describes it (exp/SEAL_interface_evolution.yaml); no paper cell.
PAPER_METHOD = (
    "qwen2.5-7b__seal_paper_method",
    "Qwen2.5-7B-Instruct + SEAL, as the paper describes it (no paper cell)",
)
#: An ablation row with no run of its own takes Table 1's run of the same recipe.
ABLATION_FALLBACK = {"SEAL": "qwen2.5-7b__seal", "vanilla_rl": "qwen2.5-7b__vanilla_rl"}
#: Table 1's columns: the Average weighs each category 1/4 (= passes / 400 on the balanced held-out set).
TABLE1_WEIGHTS: dict[str, dict[str, float]] = {
    "average": {c: 1 / 4 for c in paper.COLUMNS[1:]},
    **{c: {c: 1.0} for c in paper.COLUMNS[1:]},
}
TABLE1_SIZES = dict.fromkeys(paper.COLUMNS[1:], paper.TASKS_PER_CATEGORY)


def ood_weights() -> dict[str, dict[str, float]]:
    """{OOD column: {evaluation category: weight}}: a column is the mean of its parts, an average the mean of its
    columns (the paper's V4 and tau2 averages), so every column is a weighted mean of evaluation categories."""
    weights = {col: {c: 1 / len(parts) for c in parts} for col, parts in paper.OOD_PARTS.items()}
    for col, columns in paper.OOD_AVERAGES.items():
        weights[col] = {c: w / len(columns) for part in columns for c, w in weights[part].items()}
    return {col: weights[col] for col in paper.OOD_COLUMNS}


OOD_WEIGHTS = ood_weights()


def table1_key(name: str) -> tuple[str, str] | None:
    backbone, _, training = name.partition("__")
    if backbone in BACKBONE_KEYS and training in paper.TRAININGS:
        return BACKBONE_KEYS[backbone], training
    return None


def row_key(backbone: str, training: str) -> str:
    return f"{ROW_KEYS[backbone]}__{training}"


def combine(cells: dict[str, Cell], weights: dict[str, float]) -> tuple[Cell | None, list[str]]:
    """(the weighted mean of the categories' cells, the categories missing): SE from independent categories.
    With some missing the mean is over those present (weights renormalised): a partial cell, never compared."""
    present = {c: w for c, w in weights.items() if c in cells and cells[c].n}
    missing = [c for c in weights if c not in present]
    if not present:
        return None, missing
    total = sum(present.values())
    accuracy = sum(w * cells[c].accuracy for c, w in present.items()) / total
    se = math.sqrt(sum((w / total) ** 2 * honest_stderr(cells[c]) ** 2 for c, w in present.items()))
    n = sum(cells[c].n for c in present)
    return pooled_cell(accuracy, se, n, sum(cells[c].passed or 0 for c in present)), missing


def paper_cell(value: float | None, weights: dict[str, float], sizes: dict[str, int]) -> Cell | None:
    """The paper's number as a cell: its binomial SE with every category at the column's accuracy, and its count
    of passes on the column's tasks, so that a small one (0/200, 3/100) gets the Wilson treatment ours gets."""
    if value is None:
        return None
    p = value / 100
    n = sum(sizes[c] for c in weights)
    return Cell(p, math.sqrt(p * (1 - p) * sum(w * w / sizes[c] for c, w in weights.items())), n, round(p * n))


def difference(ours: Cell | None, theirs: Cell | None) -> str:
    if ours is None or theirs is None or not ours.n or math.isnan(ours.accuracy):
        return ""
    se = math.sqrt((0 if math.isnan(ours.stderr) else honest_stderr(ours)) ** 2 + honest_stderr(theirs) ** 2)
    return f"{100 * (ours.accuracy - theirs.accuracy):+.2f} ± {100 * se:.2f}"


class Row(NamedTuple):
    """One table row: its label, our per-category cells (None: no run), the paper's numbers, and what to say when
    our run could not be read."""

    label: str
    cells: dict[str, Cell] | None
    numbers: dict[str, float | None]
    unreadable: str = ""


def comparison_table(
    rows: list[Row], titles: dict[str, str], weights: dict[str, dict[str, float]], sizes: dict[str, int]
) -> str:
    """``ours ± se | paper | ours − paper ± se`` per column; a column our run covers only partly shows which
    categories it has and is not compared; a run that could not be read is named in its row."""
    head = "| model | " + " | ".join(f"{t} (ours / paper / diff)" for t in titles.values()) + " |"
    lines = [head, "| --- |" + " --- |" * len(titles)]
    for row in rows:
        texts = []
        for column in titles:
            ours, missing = combine(row.cells or {}, weights[column])
            paper_text = f"{row.numbers[column]:.2f}" if row.numbers.get(column) is not None else ""
            if ours is not None and missing:
                have = len(weights[column]) - len(missing)
                texts.append(f"{pct(ours)} (partial: {have} of {len(weights[column])}) / {paper_text or '–'} / –")
                continue
            theirs = paper_cell(row.numbers.get(column), weights[column], sizes)
            texts.append(f"{pct(ours) or '–'} / {paper_text or '–'} / {difference(ours, theirs) or '–'}")
        label = f"{row.label} (run unreadable: {row.unreadable})" if row.unreadable else row.label
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"


# ---- the factorial interaction -----------------------------------------------------------------------------------

#: The sign of each cell of the 2x2 factorial in the interaction.
INTERACTION_SIGNS = {"both": 1, "env_only": -1, "reweighting_only": -1, "neither": 1}


class Effect(NamedTuple):
    """An interaction in accuracy units (0..1) with its standard error; ``paired``: on ``tasks`` shared tasks."""

    value: float
    stderr: float
    paired: bool
    tasks: int


def category_interaction(runs: dict[str, RunResult], category: str) -> Effect | None:
    """The interaction in one category: paired (per-task contrasts, their sample variance with n − 1) when the four runs scored
    the same tasks, else from the four accuracies as independent samples."""
    if any(category not in r.cells or not r.cells[category].n for r in runs.values()):
        return None
    prefix = f"multi_turn_{category}_"
    tasks = [{t for t in (r.verdicts or {}) if t.startswith(prefix)} for r in runs.values()]
    if all(r.verdicts for r in runs.values()) and tasks[0] and all(t == tasks[0] for t in tasks):
        shared = sorted(tasks[0])
        contrasts = [sum(s * runs[role].verdicts[t] for role, s in INTERACTION_SIGNS.items()) for t in shared]
        mean = sum(contrasts) / len(shared)
        variance = sum((d - mean) ** 2 for d in contrasts) / (len(shared) - 1) if len(shared) > 1 else 0.0
        return Effect(mean, math.sqrt(variance / len(shared)), True, len(shared))
    value = sum(s * runs[role].cells[category].accuracy for role, s in INTERACTION_SIGNS.items())
    se = math.sqrt(sum(honest_stderr(runs[role].cells[category]) ** 2 for role in INTERACTION_SIGNS))
    return Effect(value, se, False, 0)


def interaction(runs: dict[str, RunResult]) -> dict[str, Effect]:
    """{column: Effect} for the categories all four runs have, and the Average when they have all four."""
    effects = {c: e for c in paper.COLUMNS[1:] if (e := category_interaction(runs, c))}
    if len(effects) == len(paper.COLUMNS) - 1:
        k = len(effects)
        effects = {
            "average": Effect(
                sum(e.value for e in effects.values()) / k,
                math.sqrt(sum(e.stderr**2 for e in effects.values())) / k,
                all(e.paired for e in effects.values()),
                sum(e.tasks for e in effects.values()),
            ),
            **effects,
        }
    return effects


def paper_interaction() -> dict[str, Effect]:
    """The interaction its ablation table implies, per column, with SEs of independent binomial cells."""
    cells = {
        role: {c: paper_cell(paper.ABLATION[run][c], TABLE1_WEIGHTS[c], TABLE1_SIZES) for c in paper.COLUMNS}
        for role, run in paper.FACTORIAL.items()
    }
    return {
        c: Effect(
            sum(s * cells[role][c].accuracy for role, s in INTERACTION_SIGNS.items()),
            math.sqrt(sum(cells[role][c].stderr ** 2 for role in INTERACTION_SIGNS)),
            False,
            0,
        )
        for c in paper.COLUMNS
    }


def interaction_table(ours: dict[str, Effect], runs: dict[str, str]) -> str:
    """The paper's stated interaction, the one its table implies, and ours (percentage points)."""

    def text(effect: Effect | None) -> str:
        return f"{100 * effect.value:+.2f} ± {100 * effect.stderr:.2f}" if effect else "–"

    implied = paper_interaction()
    paired = [e for e in ours.values() if e.paired]
    how = f"paired on {ours['average'].tasks} shared tasks" if ours.get("average") and paired else "unpaired"
    if ours and len(paired) not in (0, len(ours)):
        how = "paired where the runs share a category's tasks"
    lines = [
        "Factorial interaction of the ablation (Qwen2.5-7B-Instruct, percentage points): full SEAL − environment "
        "adaptation only (w/o reweighting) − reweighting only (w/o environment adaptation) + neither (Vanilla RL)",
        "",
        "runs: " + ", ".join(f"{role} = {name}" for role, name in runs.items()),
        "",
        "| source | " + " | ".join(TABLE_COLUMNS.values()) + " |",
        "| --- |" + " ---: |" * len(TABLE_COLUMNS),
        f"| paper, as its revised abstract states | {paper.STATED_INTERACTION:+.2f} |" + " – |" * 4,
        "| paper, as its own ablation cells imply (± SE of independent binomial cells) | "
        + " | ".join(text(implied[c]) for c in TABLE_COLUMNS)
        + " |",
        f"| ours ({how}) | " + " | ".join(text(ours.get(c)) for c in TABLE_COLUMNS) + " |",
        "",
        versions_note(implied["average"]),
    ]
    return "\n".join(lines) + "\n"


def versions_note(implied: Effect) -> str:
    """The paper's two figures for the interaction are not two estimates from one table: say where each comes from
    and how far each is from 0, in standard errors of the four cells as independent binomial samples."""
    stated, cells, se = paper.STATED_INTERACTION, 100 * implied.value, 100 * implied.stderr
    both_small = max(abs(stated), abs(cells)) / se < Z95
    return (
        f"The paper's {stated:+.2f} (its revised abstract) and the {cells:+.2f} its ablation cells imply come from "
        f"different versions of the paper: the abstract was revised, the ablation table was not. In standard errors "
        f"of the four cells as independent binomial samples (± {se:.2f}), {stated:+.2f} lies {abs(stated) / se:.2f} "
        f"SE from 0 and {cells:+.2f} {abs(cells) / se:.2f} SE"
        + (": neither is distinguishable from no interaction (|z| < 1.96)." if both_small else ".")
    )


def discover(
    runs_dir: str, explicit: list[str], step: str, val_file: str
) -> tuple[dict[str, RunResult], dict[str, str]]:
    """(the runs that could be read, {name: why not} for those that could not). Paths are taken as given
    (relative to the working directory)."""
    paths = {}
    for entry in sorted(os.listdir(runs_dir)):
        full = os.path.join(runs_dir, entry)
        if os.path.isdir(full):
            paths[entry] = full
    for item in explicit:
        key, _, path = item.partition("=")
        paths[key] = path
    runs, unreadable = {}, {}
    for key, path in paths.items():
        try:
            runs[key] = load_run(path, key, step=step, val_file=val_file)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            unreadable[key] = f"{path}: {exc}"
            print(f"[make_tables] cannot read run {key} ({unreadable[key]})", file=sys.stderr)
    return runs, unreadable


def mcnemar(a: dict[str, bool], b: dict[str, bool]) -> dict:
    """Exact two-sided McNemar test on the tasks both runs scored: b01 = only A passed, b10 = only B passed."""
    shared = sorted(set(a) & set(b))
    only_a = sum(a[t] and not b[t] for t in shared)
    only_b = sum(b[t] and not a[t] for t in shared)
    k, n = min(only_a, only_b), only_a + only_b
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"tasks": len(shared), "only_a": only_a, "only_b": only_b, "p_value": p}


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (in their order): the i-th smallest times (m − i), made
    non-decreasing, at most 1."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def default_pairs(with_verdicts: dict[str, RunResult]) -> list[tuple[str, str]]:
    """Every pair of evaluations scored on the same tasks, but neither training runs' own validations nor a best
    checkpoint whose row has its last checkpoint evaluated: the test is on the unbiased score."""
    kept = [
        k
        for k in with_verdicts
        if not k.endswith(TRAINING_SUFFIX) and not (not k.endswith(LAST_SUFFIX) and k + LAST_SUFFIX in with_verdicts)
    ]
    return [
        (a, b)
        for a, b in itertools.combinations(kept, 2)
        if set(with_verdicts[a].verdicts) == set(with_verdicts[b].verdicts)
    ]


def mcnemar_markdown(tests: dict[str, dict]) -> str:
    lines = [
        f"Exact McNemar tests, p adjusted for the {len(tests)} pairs reported (Holm). By default every pair of "
        "evaluations scored on the same tasks, a trained row by its last checkpoint (unbiased) where it has one, "
        "never a training run's own validation.",
        "",
        "| A vs B | tasks | only A passed | only B passed | p (exact McNemar) | p (Holm) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {k} | {v['tasks']} | {v['only_a']} | {v['only_b']} | {v['p_value']:.4g} | {v['p_holm']:.4g} |"
        for k, v in tests.items()
    ]
    return "\n".join(lines) + "\n"


TABLE_FILES = ("table1.md", "ablation.md", "ood.md", "interaction.md", "runs.md", "mcnemar.md")


CHECKPOINT_NOTE = (
    "A trained row has two lines: its best checkpoint, selected on the held-out tasks it is then scored on (the "
    "paper's protocol, and the line compared with the paper), and its last checkpoint, selected by nothing (the "
    "unbiased score; mcnemar.md tests it).\n\n"
)


def checkpoint_rows(
    runs: dict[str, RunResult], key: str, label: str, numbers: dict[str, float | None], unreadable: dict[str, str]
) -> list[Row]:
    """A trained row's lines: its best checkpoint (``key``), compared with the paper's ``numbers``, and its last
    (``key__last``), shown beside it and compared with nothing."""
    return [
        Row(
            f"{label} ({CHECKPOINT_LABELS[suffix]})",
            runs[key + suffix].cells if key + suffix in runs else None,
            numbers if suffix == "" else {},
            unreadable.get(key + suffix, ""),
        )
        for suffix in CHECKPOINT_LABELS
    ]


def ablation_run(runs: dict[str, RunResult], key: str) -> RunResult | None:
    return runs.get(key) or runs.get(ABLATION_FALLBACK.get(key, ""))


def ood_run(runs: dict[str, RunResult], key: str) -> RunResult | None:
    """The run with the OOD results of a Table 1 row: its own folder, else ``<row>__ood``."""
    for name in (key, key + OOD_SUFFIX):
        if name in runs and runs[name].ood_cells:
            return runs[name]
    return None


def runs_markdown(runs: dict[str, RunResult], unreadable: dict[str, str]) -> str:
    from seal.results.tables import markdown_table

    text = markdown_table({k: r.cells for k, r in runs.items() if r.cells.get("average")})
    ood = {k: r.ood_cells for k, r in runs.items() if r.ood_cells}
    if ood:
        categories = [c for c in EVAL_OOD_CATEGORIES if any(c in cells for cells in ood.values())]
        text += "\nOut-of-distribution (evaluate-only)\n\n| run | " + " | ".join(categories) + " |\n"
        text += "| --- |" + " ---: |" * len(categories) + "\n"
        text += "".join(f"| {k} | " + " | ".join(pct(c.get(x)) for x in categories) + " |\n" for k, c in ood.items())
    notes = [f"- {k}: per-task verdicts unavailable ({r.note}); accuracies from its metrics" for k, r in runs.items()]
    notes = [n for n, r in zip(notes, runs.values()) if r.note]
    notes += [f"- {k}: unreadable ({why})" for k, why in unreadable.items()]
    return text + ("\n" + "\n".join(notes) + "\n" if notes else "")


def make_tables(
    runs: dict[str, RunResult],
    out_dir: str,
    pairs: list[tuple[str, str]] | None = None,
    unreadable: dict[str, str] | None = None,
) -> dict:
    from seal.results.figures import accuracy_bands

    unreadable = unreadable or {}
    os.makedirs(out_dir, exist_ok=True)

    def table1_rows(b: str, t: str) -> list[Row]:
        key, label = row_key(b, t), f"{b} {paper.TRAINING_NAMES[t]}"
        if t == "base":  # an untrained model: nothing selected
            return [Row(label, runs[key].cells if key in runs else None, paper.TABLE1[(b, t)], unreadable.get(key, ""))]
        return checkpoint_rows(runs, key, label, paper.TABLE1[(b, t)], unreadable)

    t1_rows = []
    for b in paper.BACKBONES:
        t1_rows += [row for t in paper.TRAININGS for row in table1_rows(b, t)]
        if b == BACKBONE_KEYS[PAPER_METHOD[0].partition("__")[0]]:
            t1_rows += checkpoint_rows(runs, PAPER_METHOD[0], PAPER_METHOD[1], {}, unreadable)
    t1_rows += [Row(f"{m} (paper's reference)", None, {"average": v}) for m, v in paper.REFERENCE_MODELS.items()]
    ab_rows = []
    for key, numbers in paper.ABLATION.items():
        folder = key if key in runs or key in unreadable else ABLATION_FALLBACK.get(key, key)
        ab_rows += checkpoint_rows(runs, folder, paper.ABLATION_NAMES[key], numbers, unreadable)
    ood_rows = []
    for b, t in paper.OOD:
        run = ood_run(runs, row_key(b, t))
        why = unreadable.get(row_key(b, t)) or unreadable.get(row_key(b, t) + OOD_SUFFIX, "")
        ood_rows.append(Row(f"{b} {paper.TRAINING_NAMES[t]}", run and run.ood_cells, paper.OOD[(b, t)], why))
    ood_titles = {c: paper.OOD_COLUMN_TITLES[c] for c in paper.OOD_COLUMNS}
    factorial = {role: ablation_run(runs, key) for role, key in paper.FACTORIAL.items()}
    effects = interaction({r: run for r, run in factorial.items()}) if all(factorial.values()) else {}
    texts = {
        "table1.md": "Table 1 (accuracy %, ours ± standard error / paper / ours − paper ± standard error)\n\n"
        + CHECKPOINT_NOTE
        + comparison_table(t1_rows, TABLE_COLUMNS, TABLE1_WEIGHTS, TABLE1_SIZES),
        "ablation.md": "Table 3, the ablation on Qwen2.5-7B-Instruct (accuracy %, ours / paper / difference)\n\n"
        + CHECKPOINT_NOTE
        + comparison_table(ab_rows, TABLE_COLUMNS, TABLE1_WEIGHTS, TABLE1_SIZES),
        "ood.md": "Out-of-distribution (accuracy %, ours / paper / difference): BFCL V4 and tau2-bench\n\n"
        + comparison_table(ood_rows, ood_titles, OOD_WEIGHTS, paper.OOD_TASKS),
        "interaction.md": interaction_table(
            effects, {role: run.name if run else "(no run)" for role, run in factorial.items()}
        ),
        "runs.md": runs_markdown(runs, unreadable),
    }
    with_verdicts = {k: r for k, r in runs.items() if r.verdicts}
    if pairs is None:
        pairs = default_pairs(with_verdicts)
    tests = {
        f"{a} vs {b}": mcnemar(runs[a].verdicts, runs[b].verdicts)
        for a, b in pairs
        if a in with_verdicts and b in with_verdicts
    }
    for test, adjusted in zip(tests.values(), holm([t["p_value"] for t in tests.values()])):
        test["p_holm"] = adjusted
    texts["mcnemar.md"] = mcnemar_markdown(tests)
    for name, text in texts.items():
        Path(out_dir, name).write_text(text)
    summary = {
        "runs": {
            k: {
                "path": os.path.abspath(r.path),
                "step": r.step,
                "cells": {c: vars(v) for c, v in r.cells.items()},
                "ood_cells": {c: vars(v) for c, v in r.ood_cells.items()},
                "note": r.note,
            }
            for k, r in runs.items()
        },
        "unreadable": unreadable,
        "interaction": {
            "stated_by_paper": paper.STATED_INTERACTION,
            "implied_by_paper_table": {c: 100 * e.value for c, e in paper_interaction().items()},
            "ours": {
                c: {"value": 100 * e.value, "stderr": 100 * e.stderr, "paired": e.paired, "tasks": e.tasks}
                for c, e in effects.items()
            },
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
        help=f"the training runs' data.val_files (row order of their validation dumps; default: the repository's "
        f"{DEFAULT_VAL_FILE})",
    )
    args = parser.parse_args(argv)
    # The user's paths are relative to where they ran the command; the default validation file is the repository's.
    val_file = os.path.abspath(args.val_file) if args.val_file else str(ROOT / DEFAULT_VAL_FILE)
    runs_dir, out = os.path.abspath(args.runs_dir), os.path.abspath(args.out)
    rows = [f"{k}={os.path.abspath(p)}" for k, _, p in (item.partition("=") for item in args.row)]
    if not os.path.isdir(runs_dir):
        print(f"[make_tables] {runs_dir} is not a folder", file=sys.stderr)
        return 1
    runs, unreadable = discover(runs_dir, rows, args.step, val_file)
    if not runs:
        print(f"[make_tables] no readable runs in {runs_dir}", file=sys.stderr)
        return 1
    make_tables(runs, out, [tuple(p) for p in args.mcnemar] if args.mcnemar else None, unreadable)
    for name in TABLE_FILES:
        print(Path(out, name).read_text())
    print(
        f"[make_tables] wrote {out}/: {', '.join(TABLE_FILES)}, tables.json"
        + (", accuracy_over_steps.png" if any(r.history for r in runs.values()) else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
