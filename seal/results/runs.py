"""Read what runs leave behind: a training run's metrics and validation dumps, or an evaluation's results file.

A training run (``seal.run_dir``) has ``metrics_*.jsonl`` (verl's file logger: ``{"step", "data": {...}}`` per
line; several files when the run was resumed) with ``val-core/<category>/reward/mean@1`` and
``val-core/average/reward/mean@1``, and ``validation_log/<step>.jsonl`` (verl's dump: one line per validation
episode, in the order of ``data.val_files``, with ``gts`` and ``score``). An evaluation folder
(``python -m seal.eval``) has ``results.jsonl``; its out-of-distribution records (bfcl V4, tau2-bench) are kept
apart (``RunResult.ood_cells``), never mixed into the paper's four categories.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from env_service.vocabulary import CATEGORIES
from seal.results.records import load_records, scored
from seal.results.tables import EVAL_OOD_CATEGORIES, Cell, accuracy_table, average_cell, binomial_cell, ood_table

VAL_KEY = "val-core/multi_turn_{}/reward/mean@1"
DEFAULT_VAL_FILE = "data/bfcl_heldout.parquet"


def read_metrics(run_dir: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} from every ``metrics_*.jsonl`` of a run (later lines win)."""
    steps: dict[int, dict[str, float]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics_*.jsonl"))):
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                steps.setdefault(int(entry["step"]), {}).update(entry.get("data", {}))
    return steps


def validation_steps(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """{step: {category: accuracy}} for the steps that validated."""
    out = {}
    for step, data in sorted(metrics.items()):
        acc = {c: float(data[VAL_KEY.format(c)]) for c in CATEGORIES if VAL_KEY.format(c) in data}
        if acc:
            out[step] = acc
    return out


def val_task_ids(val_file: str) -> tuple[list[str], list[str]]:
    """(task ids, ground-truth strings) of a validation parquet, in row order."""
    import pyarrow.parquet as pq

    table = pq.read_table(val_file, columns=["extra_info", "reward_model"])
    return (
        [r["task_id"] for r in table.column("extra_info").to_pylist()],
        [r["ground_truth"] for r in table.column("reward_model").to_pylist()],
    )


def dumped_verdicts(run_dir: str, step: int, val_file: str) -> tuple[dict[str, bool] | None, str]:
    """({task id: passed} of one validation from ``validation_log/<step>.jsonl``, '') -- or (None, why not) when
    there is no dump, no ``val_file``, or the rows do not line up with it (checked through every row's ground
    truth). Episodes the environment could not run are left out."""
    path = os.path.join(run_dir, "validation_log", f"{step}.jsonl")
    if not os.path.exists(path):
        return None, f"no validation dump {path}"
    if not os.path.exists(val_file):
        return None, f"validation file {val_file} not found (--val-file)"
    ids, gts = val_task_ids(val_file)
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except ValueError as exc:
        return None, f"{path} is not JSON lines: {exc}"
    if len(rows) != len(ids) or any(str(r.get("gts")) != gt for r, gt in zip(rows, gts)):
        return None, f"{path} does not line up with {val_file} ({len(rows)} rows, {len(ids)} tasks)"
    return {t: float(r["score"]) >= 1.0 for t, r in zip(ids, rows) if not _failed(r)}, ""


def _failed(row: dict) -> bool:
    """A dumped validation sample that could not run (``episode_failed``; ``env_failed`` in runs made before episodes
    carried their failure kind)."""
    return bool(float(row.get("episode_failed", row.get("env_failed", 0.0))))


@dataclass
class RunResult:
    """One run's accuracies (``cells``), per-task verdicts when known, its validation history, the
    out-of-distribution accuracies (``ood_cells``, per evaluation category) and their verdicts, and ``note``: why
    the per-task verdicts are missing ('' when they are not)."""

    name: str
    path: str
    cells: dict[str, Cell]
    verdicts: dict[str, bool] | None = None
    history: dict[int, dict[str, Cell]] = field(default_factory=dict)
    step: int | None = None
    ood_cells: dict[str, Cell] = field(default_factory=dict)
    ood_verdicts: dict[str, bool] = field(default_factory=dict)
    note: str = ""


def _cells_from_verdicts(verdicts: dict[str, bool]) -> dict[str, Cell]:
    records = [
        {"task_id": t, "category": t.removeprefix("multi_turn_").rsplit("_", 1)[0], "valid": v}
        for t, v in verdicts.items()
    ]
    return accuracy_table(records)


def _cells_from_accuracies(acc: dict[str, float], n: dict[str, int]) -> dict[str, Cell]:
    cells = {c: binomial_cell(round(a * n[c]), n[c]) if n.get(c) else Cell(a, float("nan"), 0) for c, a in acc.items()}
    cells = {c: Cell(acc[c], cell.stderr, cell.n, cell.passed) for c, cell in cells.items()}
    cells["average"] = average_cell(list(cells.values()))
    return cells


def load_run(path: str, name: str | None = None, step: str = "last", val_file: str = DEFAULT_VAL_FILE) -> RunResult:
    """An evaluation folder or a training run. For a training run ``step`` picks the validation: ``last``,
    ``best`` (highest average) or a step number."""
    name = name or os.path.basename(os.path.normpath(path))
    results = os.path.join(path, "results.jsonl")
    if os.path.exists(results):
        records = scored(load_records(results))
        ood = [r for r in records if r["category"] in EVAL_OOD_CATEGORIES]
        paper = [r for r in records if r["category"] in CATEGORIES]
        return RunResult(
            name,
            path,
            accuracy_table(paper),
            {r["task_id"]: bool(r["valid"]) for r in paper},
            ood_cells=ood_table(ood),
            ood_verdicts={r["task_id"]: bool(r["valid"]) for r in ood},
        )
    validations = validation_steps(read_metrics(path))
    if not validations:
        raise FileNotFoundError(f"{path}: neither results.jsonl nor validation metrics (metrics_*.jsonl)")
    n = _category_sizes(val_file)
    history = {s: _cells_from_accuracies(acc, n) for s, acc in validations.items()}
    if step == "last":
        chosen = max(history)
    elif step == "best":
        chosen = max(history, key=lambda s: history[s]["average"].accuracy)
    else:
        chosen = int(step)
    if chosen not in history:
        raise FileNotFoundError(f"{path}: no validation at step {chosen} (validated at {sorted(history)})")
    verdicts, note = dumped_verdicts(path, chosen, val_file)
    cells = _cells_from_verdicts(verdicts) if verdicts else history[chosen]
    return RunResult(name, path, cells, verdicts, history, chosen, note=note)


def _category_sizes(val_file: str) -> dict[str, int]:
    if not os.path.exists(val_file):
        return {}
    ids, _ = val_task_ids(val_file)
    sizes: dict[str, int] = {}
    for t in ids:
        c = t.removeprefix("multi_turn_").rsplit("_", 1)[0]
        sizes[c] = sizes.get(c, 0) + 1
    return sizes
