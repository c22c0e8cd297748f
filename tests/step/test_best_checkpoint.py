"""Best-checkpoint bookkeeping: bounded disk, no best at step 0 unless asked, records tied to their run, and a
``best`` link that is never missing. verl's checkpoint writer is the boundary: a stand-in trainer writes the
directory layout verl writes (``global_step_N/actor`` and ``latest_checkpointed_iteration.txt``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from seal.validation import AVERAGE_KEY, BestCheckpoint


def make_config(root: Path, **checkpoint):
    ckpt = {
        "save_best": True,
        "best_metric": AVERAGE_KEY,
        "best_mode": "max",
        "keep_only_best": True,
        "export_hf": False,
        "best_at_step0": False,
        **checkpoint,
    }
    return OmegaConf.create({"seal": {"checkpoint": ckpt}, "trainer": {"default_local_dir": str(root)}})


class StandInTrainer:
    def __init__(self, root: Path, best: BestCheckpoint):
        self.root, self.best, self.global_steps = root, best, 0

    def _save_checkpoint(self):  # what verl leaves on disk, then seal's prune (SealTrainer._save_checkpoint)
        (self.root / f"global_step_{self.global_steps}" / "actor").mkdir(parents=True, exist_ok=True)
        (self.root / "latest_checkpointed_iteration.txt").write_text(str(self.global_steps))
        self.best.prune()


def on_disk(root: Path) -> set[int]:
    return {int(p.name.rsplit("_", 1)[1]) for p in root.glob("global_step_*")}


def run(root: Path, accuracies: dict[int, float], save_every: int = 1, uid: str = "run-a", **checkpoint):
    best = BestCheckpoint(make_config(root, **checkpoint))
    best.bind_run(uid)
    trainer = StandInTrainer(root, best)
    history = []
    for step, acc in accuracies.items():
        trainer.global_steps = step
        if step and step % save_every == 0:
            trainer._save_checkpoint()
        best.observe(trainer, {AVERAGE_KEY: acc})
        history.append(on_disk(root))
    return best, history


def test_at_most_the_best_and_the_latest_checkpoint_stay_on_disk(tmp_path):
    best, history = run(tmp_path, {1: 0.1, 2: 0.3, 3: 0.2, 4: 0.25, 5: 0.1})
    assert all(len(kept) <= 2 for kept in history), history
    assert on_disk(tmp_path) == {2, 5}  # best (step 2) + the resume point
    assert best.best["global_step"] == 2


def test_validation_before_training_is_not_a_best_candidate_unless_asked(tmp_path):
    best, _ = run(tmp_path / "default", {0: 0.9, 1: 0.1})
    assert best.best["global_step"] == 1 and on_disk(tmp_path / "default") == {1}
    best, _ = run(tmp_path / "asked", {0: 0.9, 1: 0.1}, best_at_step0=True)
    assert best.best["global_step"] == 0


def test_a_new_run_does_not_inherit_another_runs_best(tmp_path):
    run(tmp_path, {1: 0.9}, uid="old-run")
    best, _ = run(tmp_path, {2: 0.1}, uid="new-run")
    assert best.best["global_step"] == 2 and best.best["run_uid"] == "new-run"
    record = json.loads((tmp_path / "best_checkpoint.json").read_text())
    assert record["run_uid"] == "new-run" and record["global_step"] == 2


def test_a_resumed_run_keeps_its_own_best(tmp_path):
    run(tmp_path, {1: 0.9}, uid="run-a")
    best, _ = run(tmp_path, {2: 0.1}, uid="run-a")
    assert best.best["global_step"] == 1


def test_the_best_link_is_never_missing(tmp_path, monkeypatch):
    best, _ = run(tmp_path, {1: 0.5})
    link = tmp_path / "best"
    assert os.readlink(link) == "global_step_1"

    def crash(*args, **kwargs):
        raise OSError("simulated crash while linking")

    trainer = StandInTrainer(tmp_path, best)
    trainer.global_steps = 2
    monkeypatch.setattr(os, "symlink", crash)
    with pytest.raises(OSError, match="simulated crash"):
        best.observe(trainer, {AVERAGE_KEY: 0.9})
    assert os.readlink(link) == "global_step_1"  # the previous best is still linked


def test_a_resumes_revalidation_of_its_step_does_not_replace_the_best(tmp_path):
    """A resume validates its checkpoint's step again (verl's validation before training): reported, but the
    uninterrupted run never made that validation, so a higher score there does not move the best."""
    run(tmp_path, {1: 0.5, 2: 0.2}, uid="run-a")
    first = json.loads((tmp_path / "best_checkpoint.json").read_text())
    assert first["validation"]["step"] == 1 and first["validation"]["launch"]

    best = BestCheckpoint(make_config(tmp_path))
    best.bind_run("run-a")
    trainer = StandInTrainer(tmp_path, best)
    trainer.global_steps = 2  # resumed at step 2, whose validation scored 0.2 before the crash
    out = best.observe(trainer, {AVERAGE_KEY: 0.9}, revalidation=True)
    assert out["best_checkpoint/saved"] == 0.0 and out["best_checkpoint/best_step"] == 1
    assert json.loads((tmp_path / "best_checkpoint.json").read_text()) == first
    assert os.readlink(tmp_path / "best") == "global_step_1"

    trainer.global_steps = 3  # the resumed run's own validations are candidates as before
    best.observe(trainer, {AVERAGE_KEY: 0.6})
    record = json.loads((tmp_path / "best_checkpoint.json").read_text())
    assert record["global_step"] == 3 and record["validation"]["step"] == 3
    assert record["validation"]["launch"] != first["validation"]["launch"]
