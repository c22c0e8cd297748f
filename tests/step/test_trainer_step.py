"""The SEAL part of a training step (``SealTrainer._seal_step``) on a batch shaped like the agent loop's output:
diagnosis into the capability state, A-Patch on verl's advantages, failed episodes, epoch windows, cues push."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from seal.apatch import DEFAULT_TAG_WEIGHTS as WEIGHTS
from seal.env_clients import env_client
from seal.results.runs import read_metrics
from seal.trainer import batch_trajectories
from tests.support.trainer_step import make_batch, make_trainer

REPO = Path(__file__).resolve().parents[2]


ROWS = [
    ("0", 1.0, ["pass", "correct_abstention", "pass"], ["pass", "pass", "pass"], False),
    ("0", 0.0, ["pass", "state_mismatch"], ["pass", "state_mismatch"], False),
    ("1", 1.0, ["pass"], ["pass"], False),
    ("1", 0.0, ["empty_turn_model_response"], ["missing_tool_call"], False),
    ("1", 0.0, [], [], True),  # an episode the environment could not run
]


def test_static_apatch_scales_each_trajectory_by_its_mean_tag_weight(tmp_path):
    trainer = make_trainer(tmp_path, "seal.apatch.dynamic.enable=false")
    batch, grpo = make_batch(ROWS)
    metrics = trainer._seal_step(batch)
    for i, (_, _, tags, _, failed) in enumerate(ROWS):
        scale = 1.0 if failed else min(2.0, max(0.5, sum(WEIGHTS[t] for t in tags) / len(tags)))
        assert torch.allclose(batch.batch["advantages"][i], grpo[i] * scale)
    assert metrics["seal/apatch/missing_tag_count"] == 1.0  # the failed episode carries no diagnosis
    assert metrics["seal/rollout/failed_episodes"] == 1
    assert metrics["seal/failed_episodes/environment"] == 1
    assert metrics["seal/failed_episodes/generation"] == 0
    assert torch.all(batch.batch["advantages"][4] == 0)  # and nothing of it enters the loss


def test_dynamic_weights_follow_the_capability_state(tmp_path):
    trainer = make_trainer(tmp_path)
    batch, _ = make_batch(ROWS)
    metrics = trainer._seal_step(batch)
    assert trainer.state.observe_count == 4  # failed episodes are not observed
    # state_mismatch failed in its only occurrence: its weight moves up from the static 1.0
    assert metrics["seal/apatch/tag_weight/state_mismatch"] > 1.0
    assert metrics["seal/state/observe_count"] == 4.0


def test_paper_label_vocabulary_drives_apatch_when_selected(tmp_path):
    trainer = make_trainer(tmp_path, "seal.apatch.vocabulary=paper_labels", "seal.apatch.dynamic.enable=false")
    batch, grpo = make_batch(ROWS)
    metrics = trainer._seal_step(batch)
    assert "seal/apatch/tag_frac/missing_tool_call" in metrics
    assert "seal/apatch/tag_frac/empty_turn_model_response" not in metrics
    label_weight = trainer.apatch_cfg.label_weights["missing_tool_call"]
    assert torch.allclose(batch.batch["advantages"][3], grpo[3] * min(2.0, max(0.5, label_weight)))


def test_vanilla_recipe_leaves_verl_advantages_untouched(tmp_path):
    trainer = make_trainer(
        tmp_path, "seal.diagnosis.enable=false", "seal.apatch.enable=false", "seal.apatch.dynamic.enable=false"
    )
    batch, grpo = make_batch(ROWS)
    trainer._seal_step(batch)
    assert torch.equal(batch.batch["advantages"], grpo)
    assert trainer.state.observe_count == 0


def test_epoch_change_dumps_and_resets_the_window(tmp_path):
    trainer = make_trainer(tmp_path, steps_per_epoch=1)
    trainer._seal_step(make_batch(ROWS)[0])
    trainer.global_steps = 2  # first step of epoch 1
    trainer._seal_step(make_batch(ROWS)[0])
    dump = json.loads((tmp_path / "stats" / "epoch_0.json").read_text())
    assert dump["epoch"] == 0 and dump["tags"]["state_mismatch"]["count"] == 1
    saved = json.loads((tmp_path / "state" / "seal_capability_state.json").read_text())
    assert saved["observe_count"] == 4  # saved at the epoch end, before epoch 1's batch


def test_capability_cues_receive_the_failure_profile(tmp_path):
    trainer = make_trainer(tmp_path, "env_service.bfcl.capability_cues.enable=true")
    trainer._seal_step(make_batch(ROWS)[0])
    profile = env_client(trainer.config.env_service).get_profile()["profile"]
    assert profile["tags"]["state_mismatch"]["count"] == 1


def test_a_resumed_run_sends_the_restored_profile_before_its_first_rollout(tmp_path, monkeypatch):
    """The resumed launch talks to a new service, which knows no profile: the checkpoint's goes there at once,
    so the first resumed step's prompts carry the cues the uninterrupted run's had."""
    import seal.env_clients

    monkeypatch.setattr(RayPPOTrainer, "_save_checkpoint", verl_save_marker)
    cues = "env_service.bfcl.capability_cues.enable=true"
    run_a = make_trainer(tmp_path, cues)
    run_a._seal_step(make_batch(ROWS)[0])
    run_a._save_checkpoint()  # step 1; the run and its service die here
    monkeypatch.setattr(seal.env_clients, "_CLIENTS", {})  # the resumed launch's new (in-process) service
    run_b = make_trainer(tmp_path, cues)
    monkeypatch.setattr(RayPPOTrainer, "_load_checkpoint", lambda self: setattr(self, "global_steps", 1))
    run_b._load_checkpoint()
    profile = env_client(run_b.config.env_service).get_profile()["profile"]
    assert profile["tags"]["state_mismatch"]["count"] == 1


def test_batch_trajectories_reads_the_agent_loop_fields():
    batch, _ = make_batch(ROWS)
    rows = batch_trajectories(batch)
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert rows[3]["labels"] == ["missing_tool_call"] and rows[4]["failed"] is True
    assert rows[4]["error"] == "env down" and [r["response_truncated"] for r in rows] == [False] * 4 + [True]


def test_rollout_metrics_count_cut_responses_and_failures(tmp_path):
    metrics = make_trainer(tmp_path)._seal_step(make_batch(ROWS)[0])
    assert metrics["seal/rollout/response_truncated"] == pytest.approx(1 / len(ROWS))
    assert metrics["seal/rollout/failed_episodes"] == 1


@pytest.fixture(autouse=True)
def _fresh_inprocess_env():
    from seal import env_clients

    env_clients._CLIENTS.clear()
    yield
    env_clients._CLIENTS.clear()


def test_budget_knob_from_the_recipe_reaches_apatch(tmp_path):
    trainer = make_trainer(
        tmp_path,
        "seal.apatch.dynamic.enable=false",
        "seal.apatch.budget.enable=true",
        "seal.apatch.budget.strength=0.5",
    )
    batch, grpo = make_batch(ROWS)
    trainer._seal_step(batch)
    for i in (0, 3):  # static scales 1.267 and 1.5 -> pulled halfway to 1
        tags = ROWS[i][2]
        static = sum(WEIGHTS[t] for t in tags) / len(tags)
        assert static != 1.0 and not torch.all(grpo[i] == 0)
        assert torch.allclose(batch.batch["advantages"][i], grpo[i] * (1 + 0.5 * (static - 1)))


def test_advantage_sign_flip_negates_what_the_normal_step_trains_on(tmp_path):
    static = "seal.apatch.dynamic.enable=false"
    normal, flipped = make_batch(ROWS)[0], make_batch(ROWS)[0]
    make_trainer(tmp_path / "normal", static)._seal_step(normal)
    make_trainer(tmp_path / "flipped", static, "seal.debug.advantage_sign=-1")._seal_step(flipped)
    assert normal.batch["advantages"].abs().sum() > 0
    assert torch.equal(flipped.batch["advantages"], -normal.batch["advantages"])
    with pytest.raises(ValueError, match="advantage_sign must be 1 or -1"):
        make_trainer(tmp_path / "bad", "seal.debug.advantage_sign=0")


def fake_update(monkeypatch):
    """verl's actor update is a call into the Ray workers (not what these tests are about): its metrics only."""
    monkeypatch.setattr(
        RayPPOTrainer,
        "_update_actor",
        lambda self, batch: DataProto(meta_info={"metrics": {"actor/pg_loss": [0.5, 1.5]}}),
    )


def test_a_steps_training_metrics_are_on_disk_when_its_update_returns(tmp_path, monkeypatch):
    # verl calls _update_actor before the step's validation and logs the step only after it: a validation that
    # dies (an out-of-memory at the last step) must not take the step's training metrics along
    fake_update(monkeypatch)
    trainer = make_trainer(tmp_path, "seal.validation.max_env_failure_share=0.2")  # 1 failed of 5 still trains
    trainer.global_steps = 2
    trainer._update_actor(make_batch(ROWS)[0])
    logged = read_metrics(str(tmp_path))[2]
    assert logged["actor/pg_loss"] == 1.0  # verl's reduction: the mean over micro-batches
    assert logged["seal/rollout/failed_episodes"] == 1.0 and "seal/apatch/mean_scale" in logged


def test_epoch_dump_is_drawn_at_the_epochs_last_trained_step(tmp_path):
    trainer = make_trainer(tmp_path, steps_per_epoch=2)
    for step in (1, 2):
        trainer.global_steps = step
        trainer._seal_step(make_batch(ROWS)[0])
    trainer.global_steps = 3  # where verl's counter stands when fit() returns after step 2
    trainer._finalize_epoch(0)
    assert json.loads((tmp_path / "stats" / "epoch_0.json").read_text())["global_step"] == 2


def verl_save_marker(trainer):
    root = Path(trainer.config.trainer.default_local_dir)
    (root / f"global_step_{trainer.global_steps}").mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(trainer.global_steps))


def test_a_resumed_run_dumps_the_whole_epoch(tmp_path, monkeypatch):
    fake_update(monkeypatch)
    monkeypatch.setattr(RayPPOTrainer, "_save_checkpoint", verl_save_marker)  # the workers' shards: only the marker
    run_a = make_trainer(tmp_path, steps_per_epoch=2)
    run_a._seal_step(make_batch(ROWS)[0])
    run_a._save_checkpoint()  # step 1; the run is killed here
    run_b = make_trainer(tmp_path, steps_per_epoch=2)
    monkeypatch.setattr(RayPPOTrainer, "_load_checkpoint", lambda self: setattr(self, "global_steps", 1))
    run_b._load_checkpoint()
    run_b.global_steps = 2
    run_b._seal_step(make_batch(ROWS)[0])
    run_b._finalize_epoch(0)
    dump = json.loads((tmp_path / "stats" / "epoch_0.json").read_text())
    # the labels (the vocabulary that does not drive A-Patch) of both steps, not only of the step after the resume
    assert dump["labels"]["state_mismatch"]["count"] == 2 and dump["labels"]["missing_tool_call"]["count"] == 2
    assert dump["global_step"] == 2
