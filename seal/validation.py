"""Validation metrics beyond verl's, and best-checkpoint selection.

verl reports ``val-core/<category>/reward/mean@1`` per ``data_source``. The paper's headline number is the
four-category average (= passes / 400), so we add ``val-core/average/reward/mean@1`` and select the best
checkpoint by it (the released code used ``multi_turn_base`` alone: docs/upstream-differences.md). The metric and
mode are config keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

from env_service.files import atomic_write_json
from env_service.vocabulary import CATEGORY_NAMES

AVERAGE_KEY = "val-core/average/reward/mean@1"


def category_average(metrics: dict) -> dict:
    """Mean of the per-category accuracies present in ``metrics`` (all four in a full validation)."""
    values = [
        metrics[f"val-core/{c}/reward/mean@1"] for c in CATEGORY_NAMES if f"val-core/{c}/reward/mean@1" in metrics
    ]
    if not values:
        return {}
    return {AVERAGE_KEY: float(sum(values) / len(values)), "val-aux/average/num_categories": len(values)}


def validation_table(metrics: dict, step: int) -> str:
    """A per-category accuracy table (percent), the form of the paper's Table 1."""
    rows = [f"validation @ step {step}", f"{'category':<28}{'accuracy %':>12}{'progress':>10}"]
    for c in CATEGORY_NAMES:
        acc = metrics.get(f"val-core/{c}/reward/mean@1")
        if acc is None:
            continue
        prog = metrics.get(f"val-aux/{c}/progress/mean@1", float("nan"))
        rows.append(f"{c:<28}{100 * acc:>12.2f}{prog:>10.3f}")
    if AVERAGE_KEY in metrics:
        rows.append(f"{'average':<28}{100 * metrics[AVERAGE_KEY]:>12.2f}")
    return "\n".join(rows)


class BestCheckpoint:
    """Tracks the best validation metric of *this run*; keeps its checkpoint and exports it at the end.

    Disk: with ``keep_only_best`` every save prunes, so at most two checkpoints exist at any time — the current
    best and the latest (the resume point). The record (``best_checkpoint.json``) names the run that wrote it
    (``run_uid``, which travels in the run's checkpoints): a new run in the same directory does not inherit an
    old run's best. The ``best`` link is replaced atomically, so a crash never leaves the run without one.
    Step 0 (the untrained model) is only a candidate with ``seal.checkpoint.best_at_step0``.
    """

    def __init__(self, config):
        ckpt = config.seal.checkpoint
        self.enabled = bool(ckpt.save_best)
        self.metric = ckpt.best_metric or AVERAGE_KEY
        self.mode = ckpt.best_mode
        if self.mode not in ("max", "min"):
            raise ValueError(f"seal.checkpoint.best_mode must be 'max' or 'min', got {self.mode!r}")
        self.keep_only_best = bool(ckpt.keep_only_best)
        self.export_hf = bool(ckpt.export_hf)
        self.at_step0 = bool(ckpt.best_at_step0)
        self.root = config.trainer.default_local_dir
        self.record_path = os.path.join(self.root, "best_checkpoint.json")
        self.run_uid: str | None = None
        self.launch_uid = uuid.uuid4().hex  # this launch of the run (a resume is a new launch of the same run)
        self.best: dict | None = None

    def bind_run(self, run_uid: str) -> None:
        """Adopt the record only if this run wrote it (a resumed run restores its ``run_uid`` first)."""
        self.run_uid = run_uid
        record = None
        if os.path.exists(self.record_path):
            with open(self.record_path) as f:
                record = json.load(f)
        self.best = record if record and record.get("run_uid") == run_uid else None

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best["metric_value"] if self.mode == "max" else value < self.best["metric_value"]

    def observe(self, trainer, metrics: dict, revalidation: bool = False) -> dict:
        """Record this validation; it becomes the best when it is a candidate and improves on the best.

        ``revalidation``: the validation a resumed run makes of its checkpoint's step before training on. The
        uninterrupted run never made it, so it is never a candidate: the record keeps the validation it came from.
        """
        if not self.enabled:
            return {}
        if self.metric not in metrics:
            available = sorted(k for k in metrics if k.startswith("val-core"))
            raise KeyError(
                f"seal.checkpoint.best_metric {self.metric!r} is not a validation metric; available: {available}"
            )
        value = float(metrics[self.metric])
        candidate = (trainer.global_steps > 0 or self.at_step0) and not revalidation
        saved = candidate and self._improves(value)
        if saved:
            step_dir = os.path.join(self.root, f"global_step_{trainer.global_steps}")
            if not os.path.isdir(os.path.join(step_dir, "actor")):
                trainer._save_checkpoint()
            self.best = {
                "global_step": trainer.global_steps,
                "metric_name": self.metric,
                "metric_value": value,
                "checkpoint_dir": os.path.abspath(step_dir),
                "run_uid": self.run_uid,
                # which validation: a resumed run validates its checkpoint's step again without replacing this
                "validation": {"step": trainer.global_steps, "launch": self.launch_uid, "time": _utc_now()},
            }
            self._write_record()
            self.prune()
        out = {"best_checkpoint/saved": float(saved), "best_checkpoint/current_metric": value}
        if self.best is not None:
            out.update(
                {
                    "best_checkpoint/best_metric": self.best["metric_value"],
                    "best_checkpoint/best_step": self.best["global_step"],
                }
            )
        return out

    def _write_record(self) -> None:
        atomic_write_json(self.record_path, self.best)
        link = os.path.join(self.root, "best")
        tmp = f"{link}.tmp-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(os.path.basename(self.best["checkpoint_dir"]), tmp)
        os.replace(tmp, link)  # atomic: the old link stays valid until the new one takes its place

    def prune(self) -> None:
        """Delete every step checkpoint except the best and the latest (the resume point)."""
        if not (self.enabled and self.keep_only_best) or not os.path.isdir(self.root):
            return
        keep = {os.path.basename(self.best["checkpoint_dir"])} if self.best else set()
        latest = os.path.join(self.root, "latest_checkpointed_iteration.txt")
        if os.path.exists(latest):
            with open(latest) as f:
                keep.add(f"global_step_{f.read().strip()}")
        for name in os.listdir(self.root):
            if name.startswith("global_step_") and name not in keep:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def finish(self) -> None:
        """End of training: export the best checkpoint to Hugging Face format."""
        if not self.enabled or self.best is None or not self.export_hf:
            return
        actor_dir = os.path.join(self.best["checkpoint_dir"], "actor")
        if not os.path.isdir(actor_dir):
            raise FileNotFoundError(
                f"the best checkpoint's shards are gone ({actor_dir}); trainer.max_actor_ckpt_to_keep rotated them "
                "out — leave it null with seal.checkpoint.save_best (keep_only_best prunes on every save instead)"
            )
        export_hf(self.best["checkpoint_dir"])


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def export_hf(step_dir: str) -> str:
    """Merge the FSDP shards of ``step_dir/actor`` into a Hugging Face model at ``step_dir/huggingface``."""
    target = os.path.join(step_dir, "huggingface")
    cmd = [
        sys.executable,
        "-m",
        "verl.model_merger",
        "merge",
        "--backend",
        "fsdp",
        "--local_dir",
        os.path.join(step_dir, "actor"),
        "--target_dir",
        target,
    ]
    subprocess.run(cmd, check=True)
    print(f"[seal] exported best checkpoint to {target}")
    return target
