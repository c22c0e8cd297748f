"""Training-time diagnostics: per-category window metrics, error strings seen in the environment's observations,
per-epoch JSON dumps, and a plot of values over training steps (tag weights, validation accuracy).

This collector never changes training; it only observes. It forwards every trajectory to the `CapabilityState`,
feeding it the vocabulary that drives A-Patch (progress tags by default, the paper's labels when
``apatch.vocabulary = paper_labels``), so the closed loop sees the same evidence the scaling uses. The other
vocabulary is counted here, so a dump always shows both.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from env_service.files import atomic_write_json
from env_service.vocabulary import ERROR_MARKER, EXECUTION_ERROR_PREFIX, task_category
from seal.apatch import VOCABULARIES, VOCABULARY_FIELD, vocabulary_field
from seal.capability_state import CapabilityState, CapabilityStats, clean_tags

# Error strings counted in observation texts (the released code's patterns, plus bfcl's execution errors, which
# they missed); a pattern with a group counts the group.
ERROR_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(re.escape(ERROR_MARKER) + r"[^\n]*"),
    re.compile(r'"error"\s*:\s*"([^"]+)"'),
    re.compile(r"Error from environment:[^\]]+"),
    re.compile(re.escape(EXECUTION_ERROR_PREFIX.rstrip()) + r"[^\n]*"),
)
ERROR_KEY_CHARS = 200
TOP_ERRORS = 20
METRIC_WINDOW = "seal/window"
METRIC_STATE = "seal/state"


def find_errors(text: str) -> list[str]:
    """Error strings in one observation text, each cut to 200 characters."""
    found = []
    for pattern in ERROR_PATTERNS:
        for match in pattern.finditer(text):
            value = match.group(1) if pattern.groups else match.group(0)
            found.append(value[:ERROR_KEY_CHARS])
    return found


class DiagnosticStats:
    """Observes training batches: per-category and per-tag counts live in the capability state (window and total);
    this collector adds the counts of the vocabulary that does not drive A-Patch, the error strings, and the
    weights used per step."""

    def __init__(self, state: CapabilityState | None = None, vocabulary: str = "progress_tags"):
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"vocabulary must be one of {list(VOCABULARIES)}, got {vocabulary!r}")
        self.state = state if state is not None else CapabilityState()
        self.vocabulary = vocabulary
        self.drive_field = vocabulary_field(vocabulary)
        (self.other_field,) = set(VOCABULARY_FIELD.values()) - {self.drive_field}
        self.other_window: dict[str, CapabilityStats] = {}  # window counts of the other vocabulary
        self.errors: Counter[str] = Counter()
        self.last_epoch: int | str | None = None
        self.last_step: int | None = None
        self.failed_skipped = 0  # window count of failed episodes left out of the statistics

    # ------------------------------------------------------------------ observation
    def observe_batch(
        self, trajectories: Iterable[Mapping[str, Any]], epoch: int | str | None = None, global_step: int | None = None
    ) -> None:
        """Observe a training batch. A trajectory is a mapping with ``task_id``, ``category``
        (optional: derived from the id), ``reward``, optional ``success`` (default reward >= 1),
        ``tags``, ``labels`` and ``env_texts`` (the environment's observation texts). Trajectories
        marked ``failed`` are skipped (counted in ``failed_skipped``)."""
        self.last_epoch = epoch
        self.last_step = global_step
        for traj in trajectories:
            if traj.get("failed"):
                # An episode the environment could not run carries no verdict and no diagnosis; observing it as
                # reward 0 / "unknown" would skew the closed loop (seal/failed_episodes.py).
                self.failed_skipped += 1
                continue
            task_id = traj.get("task_id")
            category = traj.get("category") or task_category(task_id)
            reward = float(traj.get("reward") or 0.0)
            success = bool(traj.get("success", False)) or reward >= 1.0
            for item in clean_tags(traj.get(self.other_field)):
                self.other_window.setdefault(item, CapabilityStats()).observe(reward, success)
            self.state.observe(category, task_id, reward, success, traj.get(self.drive_field), epoch, global_step)
            for text in traj.get("env_texts") or ():
                self.errors.update(find_errors(str(text)))

    # ------------------------------------------------------------------ checkpoints
    def window_state(self) -> dict[str, Any]:
        """What this collector's window holds beyond the capability state's (saved with a checkpoint, so a
        resumed run's epoch dump still covers the steps trained before the resume)."""
        return {
            "other_window": {k: s.to_dict() for k, s in self.other_window.items()},
            "errors": dict(self.errors),
            "failed_skipped": self.failed_skipped,
            "last_epoch": self.last_epoch,
            "last_step": self.last_step,
        }

    def load_window_state(self, saved: Mapping[str, Any]) -> None:
        self.other_window = {str(k): CapabilityStats.from_dict(v) for k, v in saved["other_window"].items()}
        self.errors = Counter(saved["errors"])
        self.failed_skipped = int(saved["failed_skipped"])
        self.last_epoch, self.last_step = saved["last_epoch"], saved["last_step"]

    # ------------------------------------------------------------------ read-outs
    def metrics(self) -> dict[str, float]:
        """Window per-category metrics and capability-state metrics. Called right after
        `observe_batch`, the dynamic weights shown are the ones from the previous step's update."""
        out: dict[str, float] = {}
        for category, stats in sorted(self.state.window["categories"].items()):
            base = f"{METRIC_WINDOW}/{category}"
            out[f"{base}/count"] = float(stats.count)
            out[f"{base}/success_rate"] = stats.success_rate
            out[f"{base}/reward_mean"] = stats.reward_mean
            out[f"{base}/partial_count"] = float(stats.partial_count)
        s = self.state
        out[f"{METRIC_STATE}/observe_count"] = float(s.observe_count)
        out[f"{METRIC_STATE}/num_tasks"] = float(len(s.tasks))
        out[f"{METRIC_STATE}/num_tags"] = float(len(s.total["tags"]))
        out[f"{METRIC_STATE}/num_category_tags"] = float(len(s.total["category_tags"]))
        for tag, weight in sorted(s.dynamic_tag_weights.items()):
            out[f"{METRIC_STATE}/dynamic_tag_weight/{tag}"] = float(weight)
        return out

    def snapshot(self) -> dict[str, Any]:
        """Window snapshot (what `dump` writes)."""
        cap = self.state.snapshot(window=True)
        per_field = {
            self.drive_field: cap["tags"],
            self.other_field: {k: s.snapshot() for k, s in sorted(self.other_window.items())},
        }
        return {
            "epoch": self.last_epoch,
            "global_step": self.last_step,
            "vocabulary": self.vocabulary,
            "categories": cap["categories"],
            "tags": cap["tags"],
            "category_tags": cap["category_tags"],
            "turn_positions": cap["turn_positions"],
            "tasks": cap["tasks"],
            "dynamic_tag_weights": cap["dynamic_tag_weights"],
            "top_errors": [[e, n] for e, n in self.errors.most_common(TOP_ERRORS)],
            "labels": per_field["labels"],
            "progress_tags": per_field["tags"],
            "failed_episodes": self.failed_skipped,
        }

    def dump(self, directory: str, epoch: int, global_step: int) -> str:
        """Write ``<directory>/epoch_<epoch>.json`` (atomically) and return its path."""
        snap = self.snapshot()
        snap["epoch"] = epoch
        snap["global_step"] = global_step
        path = os.path.join(directory, f"epoch_{epoch}.json")
        atomic_write_json(path, snap)
        return path

    def failure_profile(self, per_category: bool = False) -> dict[str, Any]:
        """The capability state's failure profile (input of the environment's capability cues)."""
        return self.state.failure_profile(per_category)

    def finalize_epoch(self, directory: str, epoch: int, global_step: int) -> str:
        """Epoch end in the released code's order: dump the window snapshot, reset the windows, then save the
        capability state (if it has a path), so the saved windows are empty. Returns the dump's path."""
        path = self.dump(directory, epoch, global_step)
        self.reset_window()
        if self.state.path:
            self.state.save()
        return path

    def reset_window(self) -> None:
        """Epoch end: clear every window, the capability state's included."""
        self.other_window = {}
        self.errors = Counter()
        self.failed_skipped = 0
        self.state.reset_window()


def plot_over_steps(
    history: Sequence[Any] | Mapping[int, Mapping[str, float]],
    path: str,
    title: str = "A-Patch dynamic tag weights",
    ylabel: str = "weight",
    reference: float | None = 1.0,
) -> str:
    """PNG of each series over training steps (tag weights; validation accuracy per category). ``history`` is
    any of [(step, {name: value})], {step: {name: value}} or [{"step": step, name: value, ...}]; ``reference``
    draws a dashed horizontal line (None: none). Uses the Agg canvas directly, so no global matplotlib backend
    is changed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    items = sorted(_history_items(history), key=lambda kv: kv[0])
    tags = sorted({t for _, weights in items for t in weights})
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for tag in tags:
        points = [(step, w[tag]) for step, w in items if tag in w]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=tag)
    if reference is not None:
        ax.axhline(reference, color="grey", linewidth=0.8, linestyle="--")
    integer_steps(ax)
    ax.set_xlabel("global step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if tags:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path


def integer_steps(ax) -> None:
    """Step ticks at integers only, even for a run of one or two steps (matplotlib's integer locator gives up
    and draws fractional ticks when fewer than two integers are in view)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _history_items(history: Any) -> list[tuple[int, dict[str, float]]]:
    if isinstance(history, Mapping):
        return [(int(k), dict(v)) for k, v in history.items()]
    items = []
    for entry in history:
        if isinstance(entry, Mapping):
            weights = {k: v for k, v in entry.items() if k != "step"}
            items.append((int(entry["step"]), weights))
        else:
            step, weights = entry
            items.append((int(step), dict(weights)))
    return items
