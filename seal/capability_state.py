"""Capability state: how often each diagnosis tag appears and how badly it does (SPEC B §6.3).

The state is the memory of SEAL's closed loop. Each trajectory's per-turn tags are observed into
*total* buckets (whole run) and *window* buckets (since the last epoch end); the window (or, when
empty, the total) then moves the per-tag utility weights that A-Patch uses (`update_dynamic_tag_weights`).

Differences from the released code, both deliberate:
* ownership: the file records a ``run_id`` and `CapabilityState.open` only restores a file written by
  the same run when resuming (upstream silently resumed any ``capability_state.json`` it found,
  SPEC B §9.2 item 11);
* saving is atomic (temporary file + fsync + ``os.replace``), so a crash never leaves half a file.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

logger = logging.getLogger(__name__)

EXCLUDED_TAGS: tuple[str, ...] = ("checker_error", "gt_error")
UNKNOWN_TAG = "unknown"
PASS_TAG = "pass"
NO_CATEGORY = "_none"
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
    def from_dict(cls, raw: Mapping[str, Any]) -> "CapabilityStats":
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
    non_pass = [t for t in tags if t != PASS_TAG]
    if non_pass:
        return Counter(non_pass).most_common(1)[0][0]  # most_common is stable: first seen wins ties
    return PASS_TAG if PASS_TAG in tags else UNKNOWN_TAG


def clean_tags(tags: Iterable[str] | None) -> list[str]:
    """Drop empty entries; an empty list becomes ``["unknown"]`` so every trajectory is counted."""
    if isinstance(tags, str):
        raise TypeError(f"tags must be a sequence of strings, got the string {tags!r}")
    cleaned = [str(t) for t in (tags or []) if t]
    return cleaned or [UNKNOWN_TAG]


def atomic_write_json(path: str, payload: Any) -> None:
    """Write JSON so that ``path`` is either the old file or the complete new one, never partial.

    tmp file in the same directory (same filesystem, so ``os.replace`` is atomic) → fsync → replace →
    best-effort fsync of the directory so the rename itself survives a power cut.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, ensure_ascii=False, indent=2, allow_nan=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Leave no stray temporary file behind; the previous `path` (if any) is untouched.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # not supported on every filesystem; the data file itself is already synced
    finally:
        os.close(dir_fd)


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
                "last_tag": UNKNOWN_TAG,
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
    def update_dynamic_tag_weights(
        self,
        base: Mapping[str, float],
        min_scale: float,
        max_scale: float,
        ema_beta: float,
        alpha: float,
        confidence_samples: int,
        excluded: Iterable[str] = EXCLUDED_TAGS,
    ) -> dict[str, float]:
        """One closed-loop step (SPEC B §6.3), stored in ``dynamic_tag_weights`` and returned.

        source = window tags if non-empty else total tags; N = occurrences of non-excluded tags.
        N = 0 → return ``base`` unchanged (nothing stored). Otherwise for every tag in
        base ∪ source ∪ previous dynamic weights:
          excluded → target 1.0;  pass → target base_t;
          else target = base_t · (1 + alpha · (count_t/N) · (1 − reward_mean_t) · min(1, count_t/C));
          target clamped to [min_scale, max_scale];
          new_t = (1 − β)·prev_t + β·target, prev_t = previous dynamic weight or base_t.
        ``confidence_samples`` below 1 behaves as 1 (full confidence from the first sample), which is
        also what the released code does; it avoids a division by zero rather than redefining 0.
        """
        if not 0.0 <= ema_beta <= 1.0:
            raise ValueError(f"ema_beta must be in [0, 1], got {ema_beta!r}")
        if min_scale > max_scale:
            raise ValueError(f"min_scale {min_scale!r} > max_scale {max_scale!r}")
        excluded = frozenset(excluded)
        source = self.window["tags"] or self.total["tags"]
        n_total = sum(s.count for t, s in source.items() if t not in excluded)
        if n_total <= 0:
            return dict(base)
        confidence_div = max(1, int(confidence_samples))
        updated: dict[str, float] = {}
        for tag in sorted(set(base) | set(source) | set(self.dynamic_tag_weights)):
            base_t = float(base.get(tag, 1.0))
            if tag in excluded:
                target = 1.0
            elif tag == PASS_TAG:
                target = base_t
            else:
                stats = source.get(tag, CapabilityStats())
                prevalence = stats.count / n_total
                stagnation = 1.0 - stats.reward_mean
                confidence = min(1.0, stats.count / confidence_div)
                target = base_t * (1.0 + alpha * prevalence * stagnation * confidence)
            target = min(max_scale, max(min_scale, target))
            previous = float(self.dynamic_tag_weights.get(tag, base_t))
            updated[tag] = (1.0 - ema_beta) * previous + ema_beta * target
        self.dynamic_tag_weights = updated
        return dict(updated)

    # ------------------------------------------------------------------ read-outs
    def has_window(self) -> bool:
        return bool(self.window["tags"])

    def failure_profile(self, per_category: bool = False) -> dict[str, Any]:
        """What the environment service's capability cues consume:
        ``{"step", "tags": {tag: {count, reward_mean}}, "categories": {category: {tag: {...}}}}``,
        from the window when it has data, else from the totals (same choice as the weight update).
        ``categories`` is filled only when ``per_category`` is true."""
        buckets = self.window if self.has_window() else self.total
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
    def load(cls, path: str) -> "CapabilityState":
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
    def open(cls, path: str, run_id: str, resume: bool) -> "CapabilityState":
        """The state this run should use, bound to ``path``.

        Restores the file only when ``resume`` is true and the file was written by ``run_id``.
        A file from another run (or any file when not resuming) is NOT inherited: the run starts
        fresh, says so loudly, and the file is overwritten at the next `save`. Upstream silently
        merged such a file into a new run (SPEC B §9.2 item 11), which contaminates ablations.
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
