"""Episodes of the out-of-distribution tasks (``ood_tasks.py``): bfcl's memory and web-search categories,
evaluate-only, with the same mechanics as a multi-turn :class:`~env_service.bfcl.episode.Episode`.

The turn mechanics, parser, limits and executor are the multi-turn episode's: tool calls are parsed from the
model's text and dispatched by name with literal JSON arguments to the public methods of bfcl's own backend
class (``MemoryAPI_kv``, ``MemoryAPI_rec_sum``, ``MemoryAPI_vector``, ``WebSearchAPI``); nothing is evaluated.
What differs:

* the system message is bfcl's: for memory, ``add_memory_instruction_system_prompt`` (the scenario's setting and
  the core memory the episode starts with), before bfcl's answer-format instruction on questions; then the tools,
  as bfcl's Qwen function-calling prompt places them;
* memory state flows between episodes as bfcl's snapshot (the JSON its backend flushes): an episode is created
  with the snapshot the previous prerequisite of its scenario left (``memory_snapshot``), the backend loads it
  through bfcl's own ``_load_scenario`` from a private scratch folder, and a prerequisite's evaluation hands back
  the snapshot its backend flushes at the end (bfcl's ``_flush_memory_to_local_file``). The first prerequisite
  of a chain starts empty whatever it is given, as in bfcl. Snapshots are checked both ways (``check_snapshot``:
  the backend's shape, valid text, at most :data:`~env_service.bfcl.ood_tasks.MAX_SNAPSHOT_BYTES`): a create with
  one that fails is refused (400/413), an evaluation whose flush fails hands back none and says why
  (``error_type`` ``memory_snapshot_too_large`` / ``memory_snapshot_invalid``);
* the verdict of a question is bfcl's ``agentic_checker`` on the last message that ran no tool call (bfcl checks
  the last step its decoder finds no call in: a plain answer, or a message it cannot decode); a prerequisite is not
  scored (``valid`` None). There are no progress tags or paper labels.

Train mode is refused: these tasks are never trained on.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from env_service.bfcl import prompts, tasks, upstream, web_guard
from env_service.bfcl.calls import backend_class
from env_service.bfcl.config import EnvConfig, RewardConfig, ServiceLimits
from env_service.bfcl.episode import Episode, StepResult
from env_service.bfcl.executor import BackendSession, clip_text
from env_service.bfcl.ood_tasks import (
    KIND_PREREQ,
    MAX_SNAPSHOT_BYTES,
    OodTask,
    is_ood_task,
    load_ood_task,
    shared_ood_task,
    unavailable_reason,
)
from env_service.bfcl.scratch import scratch_root
from env_service.sizes import measured_bytes
from env_service.vocabulary import MODE_TRAIN, MODE_VALIDATE, STEP_PARSE_ERROR

#: bfcl's error type when no message without a tool call exists (``_evaluate_single_agentic_entry``).
NO_ANSWER_ERROR = "agentic:no_last_message"


def evaluate_only_message(task_id: str) -> str:
    return (
        f"{task_id} is an out-of-distribution task (bfcl's memory / web-search categories): evaluate-only, "
        f"never trained on; create it in '{MODE_VALIDATE}' mode"
    )


def snapshot_bytes(snapshot: Any) -> int:
    return len(json.dumps(snapshot, ensure_ascii=False).encode("utf-8"))


#: Containers a snapshot nests at most (the vector backend's: snapshot, memory, store). Checked before anything
#: walks a snapshot recursively, so a deeply nested one is a clear refusal, not a RecursionError.
MAX_SNAPSHOT_DEPTH = 3


def _text(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")


def _text_map(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object of strings, got {type(value).__name__}")
    for key, text in value.items():
        _text(text, f"{where}[{clip_text(key, 80)!r}]")


def _vector_store(value: Any, where: str) -> None:
    if not isinstance(value, dict) or set(value) != {"next_id", "store"}:
        raise ValueError(f"{where} must be a JSON object with exactly 'next_id' and 'store'")
    if not isinstance(value["next_id"], int) or isinstance(value["next_id"], bool):
        raise ValueError(f"{where}.next_id must be an integer")
    _text_map(value["store"], f"{where}.store")
    if not all(key.isdigit() for key in value["store"]):
        raise ValueError(f"{where}.store's keys must be entry numbers (digits)")


#: The snapshot each memory backend flushes (bfcl's ``_flush_memory_to_local_file``): its keys and their checks.
SNAPSHOT_SHAPES: dict[str, dict[str, Any]] = {
    "MemoryAPI_kv": {"core_memory": _text_map, "archival_memory": _text_map},
    "MemoryAPI_rec_sum": {"memory": _text},
    "MemoryAPI_vector": {"core_memory": _vector_store, "archival_memory": _vector_store},
}


def _nesting_exceeds(value: Any, depth: int) -> bool:
    """True when ``value`` nests lists or objects more than ``depth`` deep (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > depth:
                return True
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


class SnapshotTooLarge(ValueError):
    """A memory snapshot over :data:`~env_service.bfcl.ood_tasks.MAX_SNAPSHOT_BYTES`."""


def check_snapshot(snapshot: Any, backend: str | None = None) -> dict | None:
    """A memory snapshot as an episode takes it: None, ``{}`` (no memory) or what ``backend``'s flush writes
    (``SNAPSHOT_SHAPES``; any backend's nesting when None), within the size cap; ValueError with one line else."""
    if snapshot is None:
        return None
    if not isinstance(snapshot, dict):
        raise ValueError(f"memory_snapshot must be a JSON object, got {type(snapshot).__name__}")
    if _nesting_exceeds(snapshot, MAX_SNAPSHOT_DEPTH):
        raise ValueError(f"memory_snapshot nests more than {MAX_SNAPSHOT_DEPTH} objects deep; no backend's does")
    try:
        size = snapshot_bytes(snapshot)
    except UnicodeEncodeError as error:  # a lone surrogate: no backend can write it to its file, no reply carry it
        bad = ascii(error.object[error.start])
        raise ValueError(f"memory_snapshot has text that is not valid Unicode (a lone surrogate {bad})") from None
    if size > MAX_SNAPSHOT_BYTES:
        raise SnapshotTooLarge(f"memory_snapshot has {size} bytes; the limit is {MAX_SNAPSHOT_BYTES}")
    if backend is not None and snapshot:
        shape = SNAPSHOT_SHAPES[backend]
        if set(snapshot) != set(shape):
            raise ValueError(
                f"a {backend} memory_snapshot has exactly the keys {sorted(shape)}; got {sorted(snapshot)[:10]}"
            )
        for key, check in shape.items():
            check(snapshot[key], f"memory_snapshot.{key}")
    return snapshot


class OodEpisode(Episode):
    """An episode of an :class:`~env_service.bfcl.ood_tasks.OodTask` (see the module docstring)."""

    def __init__(
        self,
        task: OodTask,
        mode: str = MODE_VALIDATE,
        config: EnvConfig | None = None,
        limits: ServiceLimits | None = None,
        memory_snapshot: dict | None = None,
    ):
        if mode == MODE_TRAIN:
            raise ValueError(evaluate_only_message(task.id))
        reason = unavailable_reason(task.category)
        if reason:
            raise ValueError(reason)
        if memory_snapshot is not None and not task.is_memory:
            raise ValueError(f"{task.id} takes no memory snapshot (not a memory task)")
        self._snapshot_in = check_snapshot(memory_snapshot, task.backend)
        self._snapshot_out: dict | None = None
        # The last message that ran no tool call: all the checker reads (keeping every one would keep up to
        # max_steps messages beyond what the episode counts as kept).
        self._answer: str | None = None
        # Inside the service's scratch root, so a killed worker's folders go when the service stops.
        self._scratch = tempfile.mkdtemp(prefix="seal-ood-", dir=scratch_root())
        try:
            super().__init__(task, mode, config, None, limits)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        self.info["memory_snapshot_in"] = self._snapshot_in is not None

    # -- construction ---------------------------------------------------------------------------

    def _active(self, block) -> bool:
        return False  # the original interface: no train-only feature ever applies

    def _held(self) -> list:
        return [*super()._held(), self._snapshot_in]  # the memory it started from, as Python objects

    def _initial_state_bytes(self) -> int:
        return self._measured_state()  # the memory it was given: its own

    def _disk_bytes(self) -> int:
        """The files in its scratch folder (the memory it was given, bfcl's flushes), measured as they are now."""
        total = 0
        for folder, _, names in os.walk(self._scratch):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total

    def _open_session(self) -> BackendSession:
        task: OodTask = self.task
        if task.backend == "MemoryAPI_vector":
            # bfcl loads the embedding model when its module is imported; it is in the local cache (checked
            # above), so never let the hub client try the network for it.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        instance = backend_class(task.backend)()
        if task.is_memory:
            root = Path(self._scratch)
            if self._snapshot_in is not None:  # where bfcl's _prepare_snapshot looks for the scenario's state
                folder = root / upstream.get_directory_structure_by_id(task.id) / "memory_snapshot"
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{task.scenario}_final.json").write_text(json.dumps(self._snapshot_in), encoding="utf-8")
            config = {"model_result_dir": root, "scenario": task.scenario, "test_id": task.id}
            instance._load_scenario({**config, "test_category": task.category})
        else:
            web_guard.install()  # page fetches: public addresses only, within a time and size budget
            instance._load_scenario({"show_snippet": "no_snippet" not in task.category})
        return BackendSession(task, allowed=self._allowed_names(), instances={task.backend: instance})

    def _system_prompt(self, cues: str) -> str:
        task: OodTask = self.task
        question = copy.deepcopy(task.question)
        if task.is_memory:
            instance = self._session.instances[task.backend]
            question = upstream.add_memory_instruction_system_prompt(question, task.category, task.scenario, instance)
        first = question[0][0] if question and question[0] else {}
        system = first.get("content", "") if first.get("role") == "system" else ""
        tool_prompt = prompts.tools_system_prompt(self._tools, self.config.tool_prompt_mode)
        return f"{system}\n\n{tool_prompt}" if system else tool_prompt

    # -- steps and verdict ----------------------------------------------------------------------

    def step(self, assistant_text: str) -> StepResult:
        result = super().step(assistant_text)
        info = result.info
        if not info.get("num_calls") and info.get("error_type") in (None, STEP_PARSE_ERROR):
            self._answer = assistant_text
        return result

    @property
    def answer(self) -> str | None:
        """The message the checker reads: the last one that ran no tool call (None before there is one)."""
        return self._answer

    def memory_snapshot(self) -> dict | None:
        """What bfcl's backend flushes now (prerequisites only; None otherwise); the last one after close."""
        task: OodTask = self.task
        if task.kind != KIND_PREREQ:
            return None
        if self._session.closed:
            return self._snapshot_out
        instance = self._session.instances[task.backend]
        instance._flush_memory_to_local_file()
        with open(instance.latest_snapshot_file, encoding="utf-8") as f:
            snapshot = json.load(f)
        self._held_bytes += measured_bytes(snapshot) - measured_bytes(self._snapshot_out)  # the one it hands back
        self._snapshot_out = snapshot
        return snapshot

    def evaluate(self, reward_cfg: RewardConfig | None = None) -> dict:
        task: OodTask = self.task
        result: dict[str, Any] = {
            "task_id": task.id,
            "category": task.category,
            "kind": task.kind,
            "scenario": task.scenario,
            "tags": [],
            "labels": [],
            "num_turns": len(self._records),
            "num_steps": self._num_steps,
            "terminated": self._terminated,
        }
        if task.kind == KIND_PREREQ:
            snapshot = self.memory_snapshot()
            try:  # what the next episode of the scenario takes (never a 500 for one it would refuse)
                check_snapshot(snapshot, task.backend)
            except ValueError as error:
                kind = "too_large" if isinstance(error, SnapshotTooLarge) else "invalid"
                return {**result, "valid": None, "reward": 0.0, "progress": 0.0, "memory_snapshot": None,
                        "error_type": f"memory_snapshot_{kind}", "error_message": str(error)}  # fmt: skip
            return {**result, "valid": None, "reward": 0.0, "progress": 0.0, "error_type": None,
                    "memory_snapshot": snapshot, "memory_snapshot_bytes": snapshot_bytes(snapshot)}  # fmt: skip
        answer = self.answer
        if answer is None:
            valid, error_type = False, NO_ANSWER_ERROR
        else:
            checked = upstream.agentic_checker(answer, task.possible_answers)
            valid, error_type = bool(checked["valid"]), checked.get("error_type")
        return {
            **result,
            "valid": valid,
            "reward": float(valid),
            "progress": float(valid),
            "error_type": error_type,
            "answer": None if answer is None else clip_text(answer, self.limits.max_reply_bytes),
            "possible_answers": list(task.possible_answers),
        }

    def close(self) -> None:
        if not self._session.closed:
            try:
                self.memory_snapshot()
            except (OSError, ValueError):
                pass  # the snapshot is only needed by an evaluation that already happened or never will
        super().close()
        shutil.rmtree(self._scratch, ignore_errors=True)


def load_any_task(task_id: str, shared: bool = False):
    """A multi-turn :class:`~env_service.bfcl.tasks.Task` or an :class:`OodTask` (KeyError for unknown ids): a fresh
    deep copy, or with ``shared`` the table's own, for reading only (a deep copy costs milliseconds)."""
    if is_ood_task(task_id):
        return shared_ood_task(task_id) if shared else load_ood_task(task_id)
    return tasks.shared_task(task_id) if shared else tasks.load_task(task_id)


def new_episode(
    task,
    mode: str,
    config: EnvConfig | None = None,
    profile: dict | None = None,
    limits: ServiceLimits | None = None,
    memory_snapshot: dict | None = None,
) -> Episode:
    """The episode of ``task``: an :class:`OodEpisode` for an OOD task, else a multi-turn :class:`Episode`."""
    if isinstance(task, OodTask):
        return OodEpisode(task, mode, config, limits, memory_snapshot)
    if memory_snapshot is not None:
        raise ValueError(f"{task.id} takes no memory snapshot (not a memory task)")
    return Episode(task, mode, config, profile, limits)


__all__ = [
    "NO_ANSWER_ERROR",
    "OodEpisode",
    "SnapshotTooLarge",
    "check_snapshot",
    "evaluate_only_message",
    "load_any_task",
    "new_episode",
]
