"""Out-of-distribution evaluation: bfcl's memory and web-search categories through the environment service.

Evaluate-only (``env_service/bfcl/ood_tasks.py``). A memory category runs, per scenario, the scenario's prerequisite
conversations one after the other (each episode starts from the memory snapshot the previous one's evaluation
handed back, as bfcl chains them), then every selected question of the scenario from the final snapshot, in
parallel. The chain's outcome is kept in ``<out>/memory_prereq/<category>/<scenario>.json`` (the snapshot and
each prerequisite episode's messages): a rerun reuses it and skips the questions already in the results file.
Web-search questions need no chain. Categories that cannot run here (the vector backend without its embedding
model, web search without a key) are skipped with the reason ``ood_tasks.unavailable_reason`` gives.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from env_service.bfcl.ood_tasks import (
    MEMORY_CATEGORIES,
    OOD_CATEGORIES,
    is_ood_task,
    load_ood_task,
    ood_category,
    ood_task_ids,
    prereq_chain,
    unavailable_reason,
)
from env_service.files import atomic_write_json
from seal.results.records import append_record, make_record

PREREQ_DIR = "memory_prereq"

#: Runs one episode: (task id, memory snapshot or None) -> the record (``seal.results.records.make_record``).
RunEpisode = Callable[[str, "dict | None"], dict]


@dataclass
class OodSelection:
    """The OOD questions to run (bfcl's order) and the categories skipped here, each with its reason."""

    task_ids: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def select_ood(categories: list[str], ids: list[str] | None = None, limit: int | None = None) -> OodSelection:
    """The questions of ``categories`` (the first ``limit`` of each) and the ``ids`` given; unavailable categories
    are left out and named in ``skipped``. Prerequisite ids are refused: they run as part of their scenario."""
    unknown = [c for c in categories if c not in OOD_CATEGORIES]
    if unknown:
        raise ValueError(f"unknown OOD categories {unknown}; expected some of {OOD_CATEGORIES}")
    chosen = [t for c in categories for t in ood_task_ids(c)[:limit]]
    for task_id in ids or []:
        if not is_ood_task(task_id) or task_id not in ood_task_ids(ood_category(task_id), include_prereq=True):
            raise ValueError(f"unknown OOD task id {task_id!r}")
        if task_id not in ood_task_ids(ood_category(task_id)):
            raise ValueError(f"{task_id} is a prerequisite conversation: it runs with its scenario's questions")
        chosen.append(task_id)
    selection = OodSelection()
    for task_id in dict.fromkeys(chosen):
        category = ood_category(task_id)
        reason = selection.skipped.get(category) or unavailable_reason(category)
        if reason:
            selection.skipped[category] = reason
        else:
            selection.task_ids.append(task_id)
    return selection


def prereq_file(out_dir: str, category: str, scenario: str) -> str:
    return os.path.join(out_dir, PREREQ_DIR, category, f"{scenario}.json")


class PrereqFailed(RuntimeError):
    """A prerequisite conversation could not be run: its scenario's questions cannot start."""

    def __init__(self, message: str, failed_by: str = "environment"):
        super().__init__(message)
        self.failed_by = failed_by  # the side the prerequisite failed on (``records.FAILED_BY``)


def memory_after_prereqs(run: RunEpisode, category: str, scenario: str, out_dir: str) -> dict | None:
    """The memory snapshot after the scenario's prerequisite conversations: from the file a previous run left,
    else by running them in order (the file is written once the whole chain has run)."""
    path = prereq_file(out_dir, category, scenario)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)["memory_snapshot"]
    snapshot, episodes = None, []
    for task_id in prereq_chain(category, scenario):
        record = run(task_id, snapshot)
        if record.get("failed") or not isinstance(record.get("memory_snapshot"), dict):
            raise PrereqFailed(
                f"{task_id}: {record.get('error') or 'no memory snapshot in its evaluation'}",
                record.get("failed_by") or "environment",
            )
        snapshot = record.pop("memory_snapshot")
        episodes.append(record)
    atomic_write_json(
        path, {"category": category, "scenario": scenario, "memory_snapshot": snapshot, "episodes": episodes}
    )
    return snapshot


def run_ood(
    task_ids: list[str],
    run: RunEpisode,
    results_path: str,
    out_dir: str,
    concurrency: int = 4,
    source: dict | None = None,
    on_record: Callable[[dict], None] | None = None,
) -> int:
    """Run OOD questions (the caller leaves out finished ones): memory scenarios' chains first (in parallel across
    scenarios), then the questions; a record is appended to ``results_path`` as each question finishes. A
    scenario whose chain fails records its questions as failed (a rerun tries again). Returns the records written."""
    groups: dict[tuple[str, str | None], list[str]] = {}
    for task_id in task_ids:
        category = ood_category(task_id)
        scenario = load_ood_task(task_id).scenario if category in MEMORY_CATEGORIES else None
        groups.setdefault((category, scenario), []).append(task_id)
    written = 0

    def emit(record: dict) -> None:
        nonlocal written
        append_record(results_path, record)
        written += 1
        if on_record:
            on_record(record)

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        chains = {
            key: pool.submit(memory_after_prereqs, run, key[0], key[1], out_dir)
            for key in groups
            if key[0] in MEMORY_CATEGORIES
        }
        questions = []
        for key, ids in groups.items():
            snapshot = None
            if key in chains:
                try:
                    snapshot = chains[key].result()
                except Exception as error:  # noqa: BLE001 - recorded, and retried by a rerun
                    for task_id in ids:
                        side = getattr(error, "failed_by", "environment")
                        emit(_failed(task_id, f"prerequisite conversations failed: {error}", source, side))
                    continue
            questions += [pool.submit(run, task_id, snapshot) for task_id in ids]
        for future in questions:
            emit(future.result())
    return written


def _failed(task_id: str, error: str, source: dict | None, failed_by: str = "environment") -> dict:
    return make_record(
        task_id,
        None,
        [],
        model_calls=0,
        termination="env_error",
        tokens={"prompt": 0, "completion": 0},
        source=source or {},
        failed=True,
        error=error,
        failed_by=failed_by,
    )


__all__ = ["OodSelection", "PrereqFailed", "memory_after_prereqs", "prereq_file", "run_ood", "select_ood"]
