"""Capability state: how often each diagnosis tag appears and how well trajectories carrying it do.

The state is the memory of SEAL's closed loop. Each trajectory's per-turn tags are observed into *total* buckets
(whole run) and *window* buckets (since the last epoch end); `tag_evidence` hands A-Patch the window (or, when it
is empty, the totals), from which `seal.apatch.dynamic_weights` moves the per-tag weights this state then keeps.
The file records the run that wrote it, and `CapabilityState.open` restores it only into that run when resuming
(docs/upstream-differences.md).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from env_service.files import atomic_write_json
from env_service.vocabulary import NO_CATEGORY, TAG_PASS, UNKNOWN

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1

# Bucket families; each exists as a total and a window version.
_FAMILIES = ("categories", "tags", "category_tags", "turn_positions")


@dataclass
class CapabilityStats:
    """Counts for one bucket. ``partial_count`` counts rewards strictly between 0 and 1."""

    count: int = 0
    success: int = 0
    reward_sum: float = 0.0
    partial_count: int = 0

    def observe(self, reward: float, success: bool) -> None:
        self.count += 1
        if success:
            self.success += 1
        self.reward_sum += reward
        if 0.0 < reward < 1.0:
            self.partial_count += 1

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.count if self.count else 0.0

    @property
    def success_rate(self) -> float:
        return self.success / self.count if self.count else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Persisted form (what the state file stores)."""
        return {
            "count": int(self.count),
            "success": int(self.success),
            "reward_sum": float(self.reward_sum),
            "partial_count": int(self.partial_count),
        }

    def snapshot(self) -> dict[str, Any]:
        """Human-facing form (diagnostic dumps): derived rates instead of the raw sum."""
        return {
            "count": int(self.count),
            "success": int(self.success),
            "success_rate": self.success_rate,
            "reward_mean": self.reward_mean,
            "partial_count": int(self.partial_count),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CapabilityStats:
        return cls(
            count=int(raw.get("count", 0)),
            success=int(raw.get("success", 0)),
            reward_sum=float(raw.get("reward_sum", 0.0)),
            partial_count=int(raw.get("partial_count", 0)),
        )


def turn_position_bucket(index: int, total: int) -> str:
    """Position of the ``index``-th (0-based) tag among ``total`` tags.

    Rule (matches the released code): ``only`` if total <= 1; else with r = (index + 1) / total,
    ``early`` if r <= 1/3, ``middle`` if r <= 2/3, ``late`` otherwise. So with 2 tags the first is
    ``middle`` and the second ``late``; with 3 tags: early, middle, late.
    """
    if total <= 1:
        return "only"
    ratio = (index + 1) / total
    if ratio <= 1.0 / 3.0:
        return "early"
    if ratio <= 2.0 / 3.0:
        return "middle"
    return "late"


def pack_key(prefix: str, tag: str) -> str:
    """``category::tag`` / ``position::tag`` bucket key."""
    return f"{prefix}::{tag}"


def dominant_tag(tags: Iterable[str]) -> str:
    """Most common non-pass tag (ties: first seen), else ``pass``, else ``unknown``."""
    tags = list(tags)
    non_pass = [t for t in tags if t != TAG_PASS]
    if non_pass:
        return Counter(non_pass).most_common(1)[0][0]  # most_common is stable: first seen wins ties
    return TAG_PASS if TAG_PASS in tags else UNKNOWN


def clean_tags(tags: Iterable[str] | None) -> list[str]:
    """Drop empty entries; an empty list becomes ``["unknown"]`` so every trajectory is counted."""
    if isinstance(tags, str):
        raise TypeError(f"tags must be a sequence of strings, got the string {tags!r}")
    cleaned = [str(t) for t in (tags or []) if t]
    return cleaned or [UNKNOWN]


class CapabilityState:
    """Total/window statistics per category, tag, ``category::tag``, ``position::tag``; per-task
    records; the current dynamic tag weights."""

    def __init__(self, run_id: str | None = None, path: str | None = None):
        self.run_id = run_id
        self.path = path
        self.total: dict[str, dict[str, CapabilityStats]] = {f: {} for f in _FAMILIES}
        self.window: dict[str, dict[str, CapabilityStats]] = {f: {} for f in _FAMILIES}
        self.tasks: dict[str, dict[str, Any]] = {}
        self.dynamic_tag_weights: dict[str, float] = {}
        self.last_epoch: int | str | None = None
        self.last_step: int | None = None
        self.observe_count = 0

    # ------------------------------------------------------------------ observation
    def observe(
        self,
        category: str | None,
        task_id: str | None,
        reward: float,
        success: bool,
        tags: Iterable[str] | None,
        epoch: int | str | None,
        global_step: int | None,
    ) -> str:
        """Observe one trajectory. Every tag *occurrence* observes (reward, success): a trajectory
        with three ``pass`` turns adds 3 to ``pass``. Returns the trajectory's dominant tag."""
        tags = clean_tags(tags)
        category = str(category) if category else NO_CATEGORY
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward!r} (task {task_id!r})")
        success = bool(success)

        self.last_epoch = epoch
        self.last_step = global_step
        self.observe_count += 1

        self._observe_key("categories", category, reward, success)
        for index, tag in enumerate(tags):
            self._observe_key("tags", tag, reward, success)
            self._observe_key("category_tags", pack_key(category, tag), reward, success)
            position = turn_position_bucket(index, len(tags))
            self._observe_key("turn_positions", pack_key(position, tag), reward, success)

        dominant = dominant_tag(tags)
        if task_id:
            self._observe_task(str(task_id), category, reward, success, tags, dominant, global_step)
        return dominant

    def _observe_key(self, family: str, key: str, reward: float, success: bool) -> None:
        for buckets in (self.total, self.window):
            bucket = buckets[family]
            stats = bucket.get(key)
            if stats is None:  # (not setdefault: that would build a throw-away object every call)
                stats = bucket[key] = CapabilityStats()
            stats.observe(reward, success)

    def _observe_task(self, task_id, category, reward, success, tags, dominant, global_step) -> None:
        record = self.tasks.setdefault(
            task_id,
            {
                "task_id": task_id,
                "category": category,
                "count": 0,
                "success": 0,
                "reward_sum": 0.0,
                "last_reward": 0.0,
                "last_success": False,
                "last_tag": UNKNOWN,
                "tag_counts": {},
                "last_step": None,
            },
        )
        record["category"] = category
        record["count"] += 1
        record["success"] += int(success)
        record["reward_sum"] += reward
        record["last_reward"] = reward
        record["last_success"] = success
        record["last_tag"] = dominant
        record["last_step"] = global_step
        for tag in tags:
            record["tag_counts"][tag] = record["tag_counts"].get(tag, 0) + 1

    def reset_window(self) -> None:
        self.window = {f: {} for f in _FAMILIES}

    # ------------------------------------------------------------------ closed loop
    def tag_evidence(self) -> dict[str, CapabilityStats]:
        """What the closed loop learns from: the window's tag buckets, or the totals while the window is empty."""
        return self.window["tags"] or self.total["tags"]

    # ------------------------------------------------------------------ read-outs
    def failure_profile(self, per_category: bool = False) -> dict[str, Any]:
        """What the environment service's capability cues consume:
        ``{"step", "tags": {tag: {count, reward_mean}}, "categories": {category: {tag: {...}}}}``,
        from the window when it has data, else from the totals (the same choice as `tag_evidence`).
        ``categories`` is filled only when ``per_category`` is true."""
        buckets = self.window if self.window["tags"] else self.total
        profile: dict[str, Any] = {
            "step": int(self.last_step or 0),
            "tags": {t: _profile_entry(s) for t, s in sorted(buckets["tags"].items())},
            "categories": {},
        }
        if per_category:
            for key, stats in sorted(buckets["category_tags"].items()):
                category, _, tag = key.partition("::")
                profile["categories"].setdefault(category, {})[tag] = _profile_entry(stats)
        return profile

    def snapshot(self, window: bool = True) -> dict[str, Any]:
        """Buckets (window or total) in the human-facing form, plus tasks and weights."""
        buckets = self.window if window else self.total
        out = {f: {k: s.snapshot() for k, s in sorted(buckets[f].items())} for f in _FAMILIES}
        out["tasks"] = copy.deepcopy(self.tasks)
        out["dynamic_tag_weights"] = dict(self.dynamic_tag_weights)
        return out

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """JSON-able copy of everything (what `save` writes; trainer checkpoints carry it too)."""
        data: dict[str, Any] = {"format_version": FORMAT_VERSION, "run_id": self.run_id}
        for family in _FAMILIES:
            data[f"total_{family}"] = {k: s.to_dict() for k, s in self.total[family].items()}
            data[f"window_{family}"] = {k: s.to_dict() for k, s in self.window[family].items()}
        data["tasks"] = copy.deepcopy(self.tasks)
        data["dynamic_tag_weights"] = dict(self.dynamic_tag_weights)
        data["last_epoch"] = self.last_epoch
        data["last_step"] = self.last_step
        data["observe_count"] = self.observe_count
        return data

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Replace this state's contents (including ``run_id``) with ``data`` from `state_dict`."""
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported capability state format_version {version!r}")
        self.run_id = data.get("run_id")
        for family in _FAMILIES:
            self.total[family] = _stats_map(data.get(f"total_{family}"))
            self.window[family] = _stats_map(data.get(f"window_{family}"))
        self.tasks = copy.deepcopy(dict(data.get("tasks") or {}))
        self.dynamic_tag_weights = {str(k): float(v) for k, v in (data.get("dynamic_tag_weights") or {}).items()}
        self.last_epoch = data.get("last_epoch")
        self.last_step = data.get("last_step")
        self.observe_count = int(data.get("observe_count", 0))

    def save(self, path: str | None = None) -> str:
        target = path or self.path
        if not target:
            raise ValueError("CapabilityState.save: no path given and the state has none")
        atomic_write_json(target, self.state_dict())
        return target

    @classmethod
    def load(cls, path: str) -> CapabilityState:
        """Read a state file as is (no ownership check; see `open`)."""
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(f"capability state file {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"capability state file {path} does not hold a JSON object")
        state = cls(path=path)
        state.load_state_dict(data)
        return state

    @classmethod
    def open(cls, path: str, run_id: str, resume: bool) -> CapabilityState:
        """The state this run should use, bound to ``path``.

        Restores the file only when ``resume`` is true and the file was written by ``run_id``.
        A file from another run (or any file when not resuming) is NOT inherited: the run starts
        fresh, says so loudly, and the file is overwritten at the next `save`: inheriting another run's
        failure profile would contaminate an ablation (docs/upstream-differences.md).
        """
        if not run_id:
            raise ValueError("CapabilityState.open needs a non-empty run_id")
        if not os.path.exists(path):
            return cls(run_id=run_id, path=path)
        if not resume:
            logger.warning(
                "capability state %s exists but this run (%s) is not resuming: starting a fresh "
                "capability state, NOT inheriting it; the file will be overwritten at the next save",
                path,
                run_id,
            )
            return cls(run_id=run_id, path=path)
        stored = cls.load(path)  # a corrupt file while resuming is an error, not a silent reset
        if stored.run_id != run_id:
            logger.warning(
                "capability state %s belongs to run %r, not to this run %r: starting a fresh "
                "capability state, NOT inheriting it; the file will be overwritten at the next save",
                path,
                stored.run_id,
                run_id,
            )
            return cls(run_id=run_id, path=path)
        stored.path = path
        logger.info("capability state restored from %s (run %s, observe_count %d)", path, run_id, stored.observe_count)
        return stored


def _profile_entry(stats: CapabilityStats) -> dict[str, Any]:
    return {"count": int(stats.count), "reward_mean": float(stats.reward_mean)}


def _stats_map(raw: Mapping[str, Any] | None) -> dict[str, CapabilityStats]:
    return {str(k): CapabilityStats.from_dict(v) for k, v in (raw or {}).items()}
