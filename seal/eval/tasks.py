"""Which tasks to evaluate, and the verl dataset file that runs them through training's validation."""

from __future__ import annotations

import os

from env_service.bfcl.tasks import task_ids
from env_service.vocabulary import CATEGORIES, task_category

SELECTIONS = ("heldout", "train", "all")
#: The dataset files ``scripts/make_split.py`` writes: every task is a row of one of them.
DATASET_FILES = ("data/bfcl_heldout.parquet", "data/bfcl_train.parquet")
#: The split label evaluation rows carry: anything but ``train`` runs the episode in validate mode.
EVAL_SPLIT = "eval"


def select_tasks(
    selection: str = "heldout", category: str | None = None, ids: list[str] | None = None, limit: int | None = None
) -> list[str]:
    """``heldout`` (default) | ``train`` | ``all`` tasks, or the ids given; optionally one category and the first
    ``limit`` of them (per category, keeping the split's category-major order)."""
    if ids:
        known = set(task_ids("all"))
        unknown = [t for t in ids if t not in known]
        if unknown:
            raise ValueError(f"unknown task ids: {unknown}")
        chosen = list(dict.fromkeys(ids))
    else:
        if selection not in SELECTIONS:
            raise ValueError(f"task selection must be one of {SELECTIONS}, got {selection!r}")
        chosen = task_ids(selection)
    if category:
        short = category.removeprefix("multi_turn_")
        if short not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
        chosen = [t for t in chosen if task_category(t) == f"multi_turn_{short}"]
    if limit is not None:
        per: dict[str, int] = {}
        kept = []
        for t in chosen:
            c = task_category(t)
            if per.get(c, 0) < limit:
                kept.append(t)
                per[c] = per.get(c, 0) + 1
        chosen = kept
    return chosen


def write_eval_dataset(ids: list[str], path: str, data_files: tuple[str, ...] = DATASET_FILES) -> str:
    """The rows of ``ids`` (from the split's dataset files, in the order given) as a parquet for
    ``data.val_files``, each labelled split ``eval`` so a train task is also run in validate mode."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(f) for f in data_files if os.path.exists(f)]
    if not tables:
        raise FileNotFoundError(
            f"none of {data_files} exists (run from the repository root, or `python scripts/make_split.py`)"
        )
    rows = {r["extra_info"]["task_id"]: r for t in tables for r in t.to_pylist()}
    missing = [t for t in ids if t not in rows]
    if missing:
        raise ValueError(f"tasks not in {data_files}: {missing}")
    selected = [{**rows[t], "extra_info": {**rows[t]["extra_info"], "split": EVAL_SPLIT}} for t in ids]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(selected, schema=tables[0].schema), path)
    return path
