"""One JSON line per evaluated task, appended as each task finishes: the resumable results file.

A record holds what the episode did and how it was judged::

    {"task_id", "category", "valid", "reward", "progress", "tags", "labels", "error_type",
     "termination", "model_calls", "failed", "error",
     "turns": [[{"text", "reply", "error_type", "calls": [{"name", "arguments"}]}, ...], ...],
     "tokens": {"prompt", "completion"}, "source": {...}}

``turns[t]`` lists the model's messages while it answered user turn ``t``; ``calls`` are the tool calls of a
message that the environment ran (a refused or unparseable message has none). An episode that could not be
run (``failed``: the environment service or the model server kept failing) is recorded with its error, reported
apart and left out of accuracy, as in training validation; a rerun tries it again. Lines are appended under an
exclusive lock with one ``write``, so agent-loop
workers in several processes can share a file, and an interrupted run leaves at most one partial last line,
which loading skips.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from typing import Any

from env_service.bfcl.ood_tasks import ood_category
from env_service.bfcl.parser import parse_assistant
from env_service.vocabulary import short_category, task_category


def append_record(path: str, record: dict) -> None:
    """Append one record as a JSON line (atomic with respect to other writers of the same file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # an interrupted run left a partial line: never glue a record onto it
        os.write(fd, line)
    finally:
        os.close(fd)


def load_records(path: str) -> list[dict]:
    """The complete records of a results file; the last record of a task wins; a torn last line is skipped."""
    if not os.path.exists(path):
        return []
    by_task: dict[str, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption
            if isinstance(record, dict) and record.get("task_id"):
                by_task[record["task_id"]] = record
    return list(by_task.values())


def finished_tasks(path: str) -> set[str]:
    """Tasks a rerun skips: those with a complete, non-failed record."""
    return {r["task_id"] for r in load_records(path) if not r.get("failed")}


def accepted_calls(text: str, num_calls: int, prompt_mode: str) -> list[dict]:
    """The tool calls of a message the environment ran (``num_calls`` > 0 in its step info), else []."""
    if num_calls <= 0:
        return []
    calls = []
    for call in parse_assistant(text, prompt_mode).calls:
        arguments = json.loads(call.arguments) if isinstance(call.arguments, str) else call.arguments
        calls.append({"name": call.name, "arguments": arguments})
    return calls


class TurnLog:
    """Collects an episode's messages per user turn from the environment's step replies."""

    def __init__(self, prompt_mode: str = "bfcl_qwen_fc"):
        self.prompt_mode = prompt_mode
        self.turns: list[list[dict]] = [[]]

    def add(self, text: str, reply: dict | None, info: dict | None, terminated: bool = False) -> None:
        info = info or {}
        self.turns[-1].append(
            {
                "text": text,
                "reply": (reply or {}).get("content", ""),
                "error_type": info.get("error_type"),
                "calls": accepted_calls(text, int(info.get("num_calls") or 0), self.prompt_mode),
            }
        )
        if info.get("advanced") and not terminated:  # no calls: the environment delivered the next user turn
            self.turns.append([])

    def as_list(self) -> list[list[dict]]:
        """Every user turn the model was shown (a delivered turn it never answered is an empty list)."""
        return [list(t) for t in self.turns]


#: What an OOD evaluation adds to a record (``env_service.bfcl.ood_episode``).
OOD_FIELDS = ("kind", "scenario", "answer", "possible_answers", "memory_snapshot")


def make_record(
    task_id: str,
    evaluation: dict | None,
    turns: list[list[dict]],
    *,
    model_calls: int,
    termination: str,
    tokens: dict[str, int],
    source: dict[str, Any],
    failed: bool = False,
    error: str = "",
    failed_by: str = "environment",
) -> dict:
    evaluation = evaluation or {}
    record = {
        "task_id": task_id,
        "category": short_category(evaluation.get("category") or ood_category(task_id) or task_category(task_id)),
        "valid": bool(evaluation.get("valid", False)) and not failed,
        "reward": float(evaluation.get("reward", 0.0)),
        "progress": float(evaluation.get("progress", 0.0)),
        "tags": list(evaluation.get("tags", [])),
        "labels": list(evaluation.get("labels", [])),
        "error_type": evaluation.get("error_type"),
        "termination": termination,
        "model_calls": int(model_calls),
        "failed": bool(failed),
        "failed_by": failed_by if failed else None,  # which side could not run it: FAILED_BY
        "error": error[:500],
        "turns": turns,
        "tokens": {k: int(v) for k, v in tokens.items()},
        "source": source,
    }
    for key in OOD_FIELDS:  # an out-of-distribution task's answer, or a prerequisite's memory snapshot
        if key in evaluation:
            record[key] = evaluation[key]
    return record


#: Who an episode that could not run failed on: the model (its endpoint kept failing), the environment service, or
#: (through the agent loop) the rollout server's generation, the agent loop itself or the task's data.
FAILED_BY = {
    "model": "the model endpoint",
    "environment": "the environment service",
    "generation": "the rollout server's generation",
    "agent_loop": "the agent loop",
    "task_data": "the task's data",
}


def failures_by_side(records: Iterable[dict]) -> dict[str, list[str]]:
    """{side: task ids} of the episodes that could not run (records written before sides were recorded: the
    environment's, as they were reported then)."""
    sides: dict[str, list[str]] = {}
    for r in records:
        if r.get("failed"):
            sides.setdefault(r.get("failed_by") or "environment", []).append(r["task_id"])
    return sides


def describe_failures(records: Iterable[dict]) -> str:
    """One line: how many episodes could not run, per side (empty when none)."""
    sides = failures_by_side(records)
    if not sides:
        return ""
    total = sum(len(ids) for ids in sides.values())
    parts = "; ".join(f"{len(ids)} on {FAILED_BY.get(side, side)} ({_some(ids)})" for side, ids in sides.items())
    return f"{total} episode(s) could not run and are left out of the accuracy: {parts}"


def _some(ids: list[str], shown: int = 5) -> str:
    return ", ".join(ids[:shown]) + (f", ... ({len(ids) - shown} more)" if len(ids) > shown else "")


def scored(records: Iterable[dict]) -> list[dict]:
    """The records that count for accuracy: episodes the environment could run."""
    return [r for r in records if not r.get("failed")]
