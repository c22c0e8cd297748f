"""Validation metrics beyond verl's, and best-checkpoint selection.

verl reports ``val-core/<category>/reward/mean@1`` per ``data_source``. The paper's headline number is the
four-category average (= passes / 400), so we add ``val-core/average/reward/mean@1`` and select the best
checkpoint by it (SPEC A5.4; upstream used ``multi_turn_base`` alone). The metric and mode are config keys.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

CATEGORIES = ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
AVERAGE_KEY = "val-core/average/reward/mean@1"


def category_average(metrics: dict) -> dict:
    """Mean of the per-category accuracies present in ``metrics`` (all four in a full validation)."""
    values = [metrics[f"val-core/{c}/reward/mean@1"] for c in CATEGORIES if f"val-core/{c}/reward/mean@1" in metrics]
    if not values:
        return {}
    return {AVERAGE_KEY: float(sum(values) / len(values)), "val-aux/average/num_categories": len(values)}


def category_accuracies(metrics: dict) -> dict[str, float]:
    """Accuracy per category (short names) plus the average, for plotting over validations."""
    acc = {c.removeprefix("multi_turn_"): float(metrics[f"val-core/{c}/reward/mean@1"])
           for c in CATEGORIES if f"val-core/{c}/reward/mean@1" in metrics}
    if AVERAGE_KEY in metrics:
        acc["average"] = float(metrics[AVERAGE_KEY])
    return acc


def validation_table(metrics: dict, step: int) -> str:
    """A per-category accuracy table (percent), the form of the paper's Table 2."""
    rows = [f"validation @ step {step}", f"{'category':<28}{'accuracy %':>12}{'progress':>10}"]
    for c in CATEGORIES:
        acc = metrics.get(f"val-core/{c}/reward/mean@1")
        if acc is None:
            continue
        prog = metrics.get(f"val-aux/{c}/progress/mean@1", float("nan"))
        rows.append(f"{c:<28}{100 * acc:>12.2f}{prog:>10.3f}")
    if AVERAGE_KEY in metrics:
        rows.append(f"{'average':<28}{100 * metrics[AVERAGE_KEY]:>12.2f}")
    return "\n".join(rows)


class BestCheckpoint:
    """Tracks the best validation metric; saves, records and finally exports the best checkpoint."""

    def __init__(self, config):
        ckpt = config.seal.checkpoint
        self.enabled = bool(ckpt.save_best)
        self.metric = ckpt.best_metric or AVERAGE_KEY
        self.mode = ckpt.best_mode
        if self.mode not in ("max", "min"):
            raise ValueError(f"seal.checkpoint.best_mode must be 'max' or 'min', got {self.mode!r}")
        self.keep_only_best = bool(ckpt.keep_only_best)
        self.export_hf = bool(ckpt.export_hf)
        self.root = config.trainer.default_local_dir
        self.record_path = os.path.join(self.root, "best_checkpoint.json")
        self.best = self._load_record()

    def _load_record(self) -> dict | None:
        if os.path.exists(self.record_path):
            with open(self.record_path) as f:
                return json.load(f)
        return None

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best["metric_value"] if self.mode == "max" else value < self.best["metric_value"]

    def observe(self, trainer, metrics: dict) -> dict:
        if not self.enabled:
            return {}
        if self.metric not in metrics:
            available = sorted(k for k in metrics if k.startswith("val-core"))
            raise KeyError(f"seal.checkpoint.best_metric {self.metric!r} is not a validation metric; available: {available}")
        value = float(metrics[self.metric])
        saved = self._improves(value)
        if saved:
            step_dir = os.path.join(self.root, f"global_step_{trainer.global_steps}")
            if not os.path.isdir(os.path.join(step_dir, "actor")):
                trainer._save_checkpoint()
            self.best = {"global_step": trainer.global_steps, "metric_name": self.metric,
                         "metric_value": value, "checkpoint_dir": os.path.abspath(step_dir)}
            self._write_record()
        return {"best_checkpoint/saved": float(saved), "best_checkpoint/current_metric": value,
                "best_checkpoint/best_metric": self.best["metric_value"], "best_checkpoint/best_step": self.best["global_step"]}

    def _write_record(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        tmp = self.record_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.best, f, indent=2)
        os.replace(tmp, self.record_path)
        link = os.path.join(self.root, "best")
        if os.path.islink(link):
            os.unlink(link)
        os.symlink(os.path.basename(self.best["checkpoint_dir"]), link)

    def finish(self, trainer) -> None:
        """End of training: prune non-best checkpoints (keeping the latest for resume) and export the best to HF."""
        if not self.enabled or self.best is None:
            return
        if self.keep_only_best:
            self._prune()
        if self.export_hf:
            actor_dir = os.path.join(self.best["checkpoint_dir"], "actor")
            if not os.path.isdir(actor_dir):
                raise FileNotFoundError(
                    f"the best checkpoint's shards are gone ({actor_dir}); trainer.max_actor_ckpt_to_keep rotated them "
                    "out — leave it null with seal.checkpoint.save_best (keep_only_best prunes at the end instead)"
                )
            export_hf(self.best["checkpoint_dir"])

    def _prune(self) -> None:
        keep = {os.path.basename(self.best["checkpoint_dir"])}
        latest = os.path.join(self.root, "latest_checkpointed_iteration.txt")
        if os.path.exists(latest):  # the resume point stays
            with open(latest) as f:
                keep.add(f"global_step_{f.read().strip()}")
        for name in os.listdir(self.root):
            if name.startswith("global_step_") and name not in keep:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


def export_hf(step_dir: str) -> str:
    """Merge the FSDP shards of ``step_dir/actor`` into a Hugging Face model at ``step_dir/huggingface``."""
    target = os.path.join(step_dir, "huggingface")
    cmd = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
           "--local_dir", os.path.join(step_dir, "actor"), "--target_dir", target]
    subprocess.run(cmd, check=True)
    print(f"[seal] exported best checkpoint to {target}")
    return target
