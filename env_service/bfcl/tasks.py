"""BFCL V3 multi-turn tasks (800 = 4 categories x 200) and the SEAL data split (:data:`SPLIT_RULE`).

Task ids are ``multi_turn_<category>_<index>`` with ``category`` in :data:`CATEGORIES` and
``index`` in ``0..199``. Tasks come from the pinned ``bfcl-eval`` package, loaded once per process.

Mutability: :func:`load_task` returns a fresh deep copy on every call, so an episode may freely mutate
``question``, ``functions`` (e.g. append revealed docs), ``initial_config`` etc. without affecting any
other caller. The ``Task`` object itself is frozen (fields cannot be rebound).
"""

from __future__ import annotations

import copy
import functools
import random
import threading
from dataclasses import dataclass

from env_service.bfcl import upstream
from env_service.vocabulary import CATEGORIES, CATEGORY_PREFIX

TASKS_PER_CATEGORY = 200
SPLIT_SEED = 42
SPLITS: tuple[str, ...] = ("train", "val", "test", "heldout", "all")
SPLIT_RULE = (
    "l = list(range(200)); random.Random(seed).shuffle(l); train = sorted(l[:100]), "
    "val = sorted(l[100:125]), test = sorted(l[125:]); the same indices in every category; "
    "task id multi_turn_<category>_<index>"
)


@dataclass(frozen=True)
class Task:
    """One BFCL multi-turn entry with its ground truth.

    ``functions``: the function docs visible at the start (raw BFCL docs, without bfcl's
    " Note that the provided function is in Python 3 syntax." hint; miss_func holdouts removed).
    ``holdout_functions``: turn index -> docs revealed at that turn (miss_func only; else empty).
    ``ground_truth``: per user turn, the GT call strings (Python call syntax, possibly positional).
    """

    id: str
    category: str
    index: int
    question: list[list[dict]]
    initial_config: dict
    involved_classes: list[str]
    functions: list[dict]
    holdout_functions: dict[int, list[dict]]
    ground_truth: list[list[str]]
    long_context: bool

    @property
    def data_source(self) -> str:
        """bfcl's category name, e.g. ``multi_turn_base`` (also the validation metric key)."""
        return CATEGORY_PREFIX + self.category

    @property
    def num_turns(self) -> int:
        return len(self.ground_truth)


def task_id_for(category: str, index: int) -> str:
    _check_category(category)
    return f"{CATEGORY_PREFIX}{category}_{index}"


def parse_task_id(task_id: str) -> tuple[str, int]:
    """``multi_turn_miss_func_12`` -> ``("miss_func", 12)``; ValueError when malformed."""
    if not isinstance(task_id, str) or not task_id.startswith(CATEGORY_PREFIX):
        raise ValueError(f"malformed task id {task_id!r}: expected 'multi_turn_<category>_<index>'")
    category, sep, index_text = task_id[len(CATEGORY_PREFIX) :].rpartition("_")
    if not sep or category not in CATEGORIES or not index_text.isdigit():
        raise ValueError(
            f"malformed task id {task_id!r}: expected 'multi_turn_<category>_<index>' with category in {CATEGORIES}"
        )
    return category, int(index_text)


def _check_category(category: str) -> None:
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


def _build_task(entry: dict, ground_truth_entry: dict) -> Task:
    category, index = parse_task_id(entry["id"])
    if ground_truth_entry["id"] != entry["id"]:
        raise RuntimeError(f"bfcl data out of order: {entry['id']} vs {ground_truth_entry['id']}")
    # load_dataset_entry has already replaced missed_function names by their docs and removed those
    # docs from entry["function"]; keys are turn indices as strings.
    holdouts = {int(turn): docs for turn, docs in entry.get("missed_function", {}).items()}
    task = Task(
        id=entry["id"],
        category=category,
        index=index,
        question=entry["question"],
        initial_config=entry["initial_config"],
        involved_classes=list(entry["involved_classes"]),
        functions=entry["function"],
        holdout_functions=holdouts,
        ground_truth=ground_truth_entry["ground_truth"],
        long_context=category == "long_context",
    )
    if len(task.question) != len(task.ground_truth):
        raise RuntimeError(f"{task.id}: {len(task.question)} question turns vs {len(task.ground_truth)} GT turns")
    return task


_LOAD_LOCK = threading.Lock()


def _all_tasks() -> dict[str, Task]:
    """All 800 tasks, parsed once per process (a lock: concurrent first callers must not each build them)."""
    with _LOAD_LOCK:
        return _build_all_tasks()


@functools.lru_cache(maxsize=1)
def _build_all_tasks() -> dict[str, Task]:
    """All 800 tasks, parsed once per process. Private: never hand these objects out (shared)."""
    tasks: dict[str, Task] = {}
    for category in CATEGORIES:
        bfcl_category = upstream.DATASET_CATEGORY_PREFIX + category
        # include_language_specific_hint=False keeps the docs free of bfcl's "Python 3 syntax" suffix
        # (and load_dataset_entry reads fresh dicts per entry, so no description mutation is shared).
        entries = upstream.load_dataset_entry(bfcl_category, include_prereq=False, include_language_specific_hint=False)
        answers = upstream.load_ground_truth_entry(bfcl_category)
        if len(entries) != TASKS_PER_CATEGORY or len(answers) != TASKS_PER_CATEGORY:
            raise RuntimeError(f"{bfcl_category}: expected {TASKS_PER_CATEGORY} entries")
        for entry, answer in zip(entries, answers):
            task = _build_task(entry, answer)
            tasks[task.id] = task
    return tasks


def load_task(task_id: str) -> Task:
    """The task with this id, as a fresh deep copy (safe to mutate). KeyError for unknown ids."""
    try:
        task = _all_tasks()[task_id]
    except KeyError:
        raise KeyError(
            f"unknown task id {task_id!r}; expected 'multi_turn_<category>_<index>' with category in "
            f"{CATEGORIES} and index 0..{TASKS_PER_CATEGORY - 1}"
        ) from None
    return copy.deepcopy(task)


def shared_task(task_id: str) -> Task:
    """The task table's own copy of the task, not a deep copy: for reading only (its id, category, turns, tools),
    never to give an episode. KeyError for unknown ids."""
    return _all_tasks()[task_id]


def all_task_ids(category: str | None = None) -> list[str]:
    """All task ids, category-major then numeric index (optionally one category)."""
    categories = CATEGORIES if category is None else (category,)
    for cat in categories:
        _check_category(cat)
    return [task_id_for(cat, i) for cat in categories for i in range(TASKS_PER_CATEGORY)]


def split_indices(seed: int = SPLIT_SEED) -> dict[str, list[int]]:
    """The released split: the same train/val/test indices for every category (:data:`SPLIT_RULE`)."""
    order = list(range(TASKS_PER_CATEGORY))
    random.Random(seed).shuffle(order)
    return {
        "train": sorted(order[:100]),
        "val": sorted(order[100:125]),
        "test": sorted(order[125:]),
    }


def task_ids(split: str, seed: int = SPLIT_SEED) -> list[str]:
    """Task ids of a split, category-major then index.

    ``heldout`` = all val rows (base, miss_func, miss_param, long_context) then all test rows, the
    row order of the validation parquet. ``all`` = every task.
    """
    if split == "all":
        return all_task_ids()
    if split == "heldout":
        return task_ids("val", seed) + task_ids("test", seed)
    if split not in ("train", "val", "test"):
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    indices = split_indices(seed)[split]
    return [task_id_for(cat, i) for cat in CATEGORIES for i in indices]


def split_of(task_id: str, seed: int = SPLIT_SEED) -> str:
    """``train``, ``val`` or ``test`` for a task id (ValueError when malformed)."""
    _, index = parse_task_id(task_id)
    for name, indices in split_indices(seed).items():
        if index in indices:
            return name
    raise ValueError(f"index out of range in task id {task_id!r}")
