"""Episodes that could not run stay out of GRPO statistics and out of validation accuracy, each counted and stopped
for the kind of what failed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from seal.advantage import SEAL_GRPO
from seal.apatch import apply_apatch
from seal.failed_episodes import (
    FAILED_KEY,
    FAILURE_KINDS,
    KIND_KEY,
    TooManyFailedEpisodes,
    failure_shares,
    split_validation_failures,
    stop_if_too_many_failed,
)
from tests.support.processes import repo_script

EPS = 1e-6


def shares(env: float = 0.02, other: float = 0.02) -> dict:
    return failure_shares(OmegaConf.create({"max_env_failure_share": env, "max_other_failure_share": other}))


def make_batch(rewards, uids, failed, length=3, kind="environment"):
    """Outcome rewards on the last response token, as verl's reward manager places them; failed rows of ``kind``,
    with the empty loss mask the agent loop gives an episode that could not run (tests/rollout/test_agent_loop.py)."""
    scores = torch.zeros(len(rewards), length)
    scores[:, -1] = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), length)
    mask[torch.tensor(failed, dtype=torch.bool)] = 0
    return DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": mask},
        non_tensors={
            "uid": np.array(uids, dtype=object),
            "seal_failed": np.array(failed, dtype=object),
            "seal_failure_kind": np.array([kind if f else "" for f in failed], dtype=object),
            "seal_error": np.array([f"{kind} broke" if f else "" for f in failed], dtype=object),
        },
    )


def advantages(batch, estimator=SEAL_GRPO, norm_adv_by_std=True) -> torch.Tensor:
    """The batch's advantages as verl's ``fit`` computes them, with the recipe's estimator looked up by name."""
    config = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": norm_adv_by_std})
    return compute_advantage(batch, estimator, norm_adv_by_std_in_grpo=norm_adv_by_std, config=config).batch[
        "advantages"
    ]


def grpo_by_hand(rewards):
    """The GRPO formula written out: (r - mean) / (unbiased std + eps)."""
    r = np.array(rewards, dtype=float)
    return (r - r.mean()) / (r.std(ddof=1) + EPS)


def test_failed_episode_is_left_out_of_its_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    uids = ["a", "a", "a", "a", "b", "b"]
    failed = [False, False, False, True, False, False]
    adv = advantages(make_batch(rewards, uids, failed))[:, 0].numpy()
    # group a as if the failed episode had never been there: three members, not four
    np.testing.assert_allclose(adv[:3], grpo_by_hand(rewards[:3]), rtol=1e-5)
    assert adv[3] == 0.0  # the failed episode carries no signal
    np.testing.assert_allclose(adv[4:], grpo_by_hand(rewards[4:]), rtol=1e-5)  # other groups unchanged
    # ... which differs from what verl's GRPO gives, with the failed reward-0 episode in its group
    verl_grpo = advantages(make_batch(rewards, uids, failed), estimator="grpo")[:, 0].numpy()
    np.testing.assert_allclose(verl_grpo[:3], grpo_by_hand(rewards[:4])[:3], rtol=1e-5)
    assert not np.allclose(adv[:3], verl_grpo[:3])


def test_without_std_normalisation_only_the_mean_is_removed():
    batch = make_batch([1.0, 0.0, 0.0], ["a", "a", "a"], [False, False, True])
    np.testing.assert_allclose(advantages(batch, norm_adv_by_std=False)[:, 0].numpy(), [0.5, -0.5, 0.0], atol=1e-6)


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_a_lone_survivor_of_a_failed_group_gets_no_advantage(norm_adv_by_std):
    # group a: three of four episodes failed on the environment side, the survivor has reward 1
    rewards = [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    batch = make_batch(rewards, ["a", "a", "a", "a", "b", "b"], [True, True, False, True, False, False])
    adv = advantages(batch, norm_adv_by_std=norm_adv_by_std)
    # nothing to compare the survivor with: no signal, not its raw reward (verl's one-member group: mean 0, std 1)
    assert torch.all(adv[:4] == 0.0) and torch.all(batch.batch["returns"][:4] == 0.0)
    expected_b = grpo_by_hand(rewards[4:]) if norm_adv_by_std else np.array(rewards[4:]) - np.mean(rewards[4:])
    np.testing.assert_allclose(adv[4:, 0].numpy(), expected_b, rtol=1e-5)
    # ... so A-Patch, which only scales, cannot make a signal out of it either
    scaled, _ = apply_apatch(adv, [["spurious_tool_call"]] * 6, {"enable": True}, global_step=1)
    assert torch.all(scaled[:4] == 0.0)


def test_every_verl_process_knows_the_recipes_estimator():
    """verl's own trainer (its TaskRunner imports verl, not seal) must find ``seal_grpo``: seal's verl plugin
    registers it at ``import verl``."""
    code = "import verl\nfrom verl.trainer.ppo.core_algos import get_adv_estimator_fn\nprint(get_adv_estimator_fn('seal_grpo').__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "seal.advantage", out.stderr[-2000:]


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_a_batch_without_failures_gets_verls_grpo(norm_adv_by_std):
    rewards, uids = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], ["a", "a", "a", "b", "b", "b"]
    ours = advantages(make_batch(rewards, uids, [False] * 6), norm_adv_by_std=norm_adv_by_std)
    verl_grpo = advantages(make_batch(rewards, uids, [False] * 6), "grpo", norm_adv_by_std=norm_adv_by_std)
    assert torch.equal(ours, verl_grpo)


def validation_inputs(failed_flags, kind="environment"):
    n = len(failed_flags)
    sources = np.array(["multi_turn_base", "multi_turn_miss_func"] * (n // 2))
    infos = {
        "reward": [0.0] * n,
        "progress": [0.5] * n,
        FAILED_KEY: [float(f) for f in failed_flags],
        KIND_KEY: [kind if f else "" for f in failed_flags],
        "failure_error": [f"{kind} broke at {i}" if f else "" for i, f in enumerate(failed_flags)],
    }
    return sources, [f"u{i}" for i in range(n)], infos, [np.arange(n)]


def test_validation_drops_failed_samples_and_reports_them_apart():
    sources, uids, infos, turns = validation_inputs([0, 1, 0, 0])
    (kept_sources, kept_uids, kept_infos, kept_turns), metrics = split_validation_failures(
        sources, uids, infos, turns, shares(env=0.5)
    )
    assert list(kept_uids) == ["u0", "u2", "u3"]
    assert list(kept_sources) == ["multi_turn_base", "multi_turn_base", "multi_turn_miss_func"]
    assert not {FAILED_KEY, KIND_KEY, "failure_error"} & set(kept_infos) and kept_infos["reward"] == [0.0, 0.0, 0.0]
    assert kept_turns[0].tolist() == [0, 2, 3]
    assert metrics["val-aux/failed_episodes/count"] == 1 and metrics["val-aux/failed_episodes/share"] == 0.25
    assert metrics["val-aux/failed_episodes/multi_turn_miss_func/count"] == 1
    assert metrics["val-aux/failed_episodes/environment/count"] == 1
    assert metrics["val-aux/failed_episodes/generation/count"] == 0


def test_too_many_environment_failures_stop_the_run():
    sources, uids, infos, turns = validation_inputs([1, 1, 0, 0])
    with pytest.raises(
        TooManyFailedEpisodes, match=r"^validation: 2 of 4 .*environment side .*'environment broke at 0'"
    ):
        split_validation_failures(sources, uids, infos, turns, shares(env=0.25, other=1.0))


@pytest.mark.parametrize("kind", [k for k in FAILURE_KINDS if k != "environment"])
def test_each_other_kind_has_its_own_stop_and_never_counts_as_the_environments(kind):
    """Failures of another kind pass the environment's threshold untouched, and stop at their own, named for it."""
    sources, uids, infos, turns = validation_inputs([1, 1, 0, 0], kind)
    _, metrics = split_validation_failures(sources, uids, infos, turns, shares(env=0.0, other=0.5))
    assert metrics[f"val-aux/failed_episodes/{kind}/count"] == 2
    assert metrics["val-aux/failed_episodes/environment/count"] == 0
    with pytest.raises(
        TooManyFailedEpisodes, match=rf"kind {kind}, .*max_other_failure_share=0.25\), e.g. '{kind} broke"
    ) as caught:
        split_validation_failures(sources, uids, infos, turns, shares(env=1.0, other=0.25))
    assert "environment side" not in str(caught.value) and caught.value.kind == kind


def test_a_training_step_past_the_failure_share_stops_the_run_naming_the_step():
    batch = make_batch([0.0] * 4, ["a", "a", "b", "b"], [True, False, False, True])
    refused = "connection refused\n(after 3 tries)"
    batch.non_tensor_batch["seal_error"] = np.array([refused, "", "", refused], dtype=object)
    with pytest.raises(TooManyFailedEpisodes, match=r"^training step 7: 2 of 4 episodes .*'connection refused \(after"):
        stop_if_too_many_failed(batch, step=7, shares=shares(env=0.25))
    stop_if_too_many_failed(batch, step=7, shares=shares(env=0.5))  # at the threshold the step trains


@pytest.mark.parametrize(
    "failed, validate, kept",
    [
        ([True, True], False, False),  # nothing to train on: verl's rollout correction would refuse the batch
        ([True, False], False, True),  # one trained episode is enough
        ([True, True], True, True),  # validation computes no rollout correction
    ],
)
def test_a_step_where_every_episode_failed_still_runs(monkeypatch, failed, validate, kept):
    from verl.experimental.agent_loop import AgentLoopManager

    output = DataProto.from_dict(
        tensors={"rollout_log_probs": torch.zeros(len(failed), 3), "response_mask": torch.zeros(len(failed), 3)},
        non_tensors={
            "seal_failed": np.array(failed, dtype=object),
            "seal_failure_kind": np.array(["environment" if f else "" for f in failed], dtype=object),
            "seal_error": np.array([""] * len(failed)),
        },
    )
    monkeypatch.setattr(AgentLoopManager, "generate_sequences", lambda self, prompts: output)
    prompts = DataProto.from_dict(tensors={"x": torch.zeros(len(failed), 1)}, meta_info={"validate": validate})
    result = bare_manager().generate_sequences(prompts)
    assert ("rollout_log_probs" in result.batch.keys()) is kept


def bare_manager(step_seeds: bool = True, max_share: float = 1.0):
    """seal's manager without verl's workers (``generate_sequences`` of verl's is replaced in these tests)."""
    from seal.failed_episodes import SealAgentLoopManager

    manager = SealAgentLoopManager.__new__(SealAgentLoopManager)
    manager.config = OmegaConf.create(
        {
            "seal": {
                "rollout": {"step_seeds": step_seeds},
                "validation": {"max_env_failure_share": max_share, "max_other_failure_share": max_share},
            },
            "actor_rollout_ref": {"rollout": {"seed": 42}},
        }
    )
    return manager


@pytest.mark.parametrize("validate", [False, True])
def test_a_step_past_the_failure_share_stops_as_its_rollout_returns(monkeypatch, validate):
    """verl's fit calls the manager for a step's rollout before its old and reference log-probs: a training step the
    environment failed stops the run there, so it pays for neither (validation is judged over all its batches)."""
    from verl.experimental.agent_loop import AgentLoopManager

    output = make_batch([0.0] * 4, ["a", "a", "b", "b"], [True, False, False, False])
    output.non_tensor_batch["seal_error"] = np.array(["env down", "", "", ""], dtype=object)
    monkeypatch.setattr(AgentLoopManager, "generate_sequences", lambda self, prompts: output)
    prompts = DataProto.from_dict(tensors={"x": torch.zeros(4, 1)}, meta_info={"validate": validate, "global_steps": 2})
    manager = bare_manager(max_share=0.1)
    if validate:
        assert manager.generate_sequences(prompts) is output
        return
    with pytest.raises(
        TooManyFailedEpisodes, match="^training step 2: 1 of 4 episodes .*'env down'.*before the step's log"
    ):
        manager.generate_sequences(prompts)
    assert bare_manager(max_share=0.25).generate_sequences(prompts) is output  # at the threshold the step trains


@pytest.mark.parametrize(
    "validate, step_seeds, seeded", [(False, True, True), (True, True, False), (False, False, False)]
)
def test_training_samples_reach_the_workers_seeded_by_their_step(monkeypatch, validate, step_seeds, seeded):
    from verl.experimental.agent_loop import AgentLoopManager

    from seal.resume import SEED_FIELD

    seen = []
    monkeypatch.setattr(AgentLoopManager, "generate_sequences", lambda self, prompts: seen.append(prompts) or prompts)
    monkeypatch.setattr("seal.failed_episodes.failed_mask", lambda output: np.zeros(len(output), dtype=bool))
    prompts = DataProto.from_dict(tensors={"x": torch.zeros(4, 1)}, meta_info={"validate": validate, "global_steps": 3})
    bare_manager(step_seeds).generate_sequences(prompts)
    assert (SEED_FIELD in seen[0].non_tensor_batch) is seeded
    if seeded:
        assert len(set(seen[0].non_tensor_batch[SEED_FIELD].tolist())) == 4


# ---- a failed generation is named for the generation -------------------------------------------------------------


class _DeadEngine:
    """A rollout server whose engine died: every ``generate`` raises as a vLLM or Ray error would."""

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        raise RuntimeError("vLLM engine core died: CUDA error: an illegal memory access")


def test_a_generation_that_raises_is_counted_and_stopped_as_the_generations_not_the_environments(tokenizer):
    """Through the real agent loop and service: the episode whose generation raised fails as ``generation`` (no
    retry: the environment is fine), the step's metrics count it there, and the stop names the kind, the count and
    the error; the launcher's line does not point at the environment service's log."""
    from seal.launch.service import RunStopped, _naming_the_service
    from seal.trainer import batch_trajectories, rollout_metrics

    FUZZ = repo_script("benchmarks/fuzz_model_output.py")
    config = FUZZ.loop_config("inprocess", max_model_calls=2)
    dead = FUZZ.run_loop(config, tokenizer, [], "multi_turn_miss_func_121", "train", server=_DeadEngine())
    fields = dead.extra_fields
    assert fields["seal_failed"] and fields["seal_failure_kind"] == "generation", fields
    assert fields["seal_error"].startswith("RuntimeError: vLLM engine core died"), fields["seal_error"]
    assert fields["seal_termination"] == "generation_error"
    assert fields["reward_extra_info"]["failure_kind"] == "generation"

    rows = [fields] + [{**fields, "seal_failed": False, "seal_failure_kind": "", "seal_error": ""}] * 3
    batch = DataProto.from_dict(
        tensors={"token_level_scores": torch.zeros(4, 3)},
        non_tensors={
            key: np.array([row[key] for row in rows], dtype=object) for key in fields if key.startswith("seal_")
        },
    )
    metrics = rollout_metrics(batch_trajectories(batch))
    assert metrics["seal/failed_episodes/generation"] == 1 and metrics["seal/failed_episodes/environment"] == 0
    with pytest.raises(TooManyFailedEpisodes) as stopped:
        stop_if_too_many_failed(batch, step=3, shares=shares(env=0.0, other=0.2))
    message = str(stopped.value)
    assert message.startswith("training step 3: 1 of 4 episodes failed in generation (the rollout server)"), message
    assert "kind generation" in message and "vLLM engine core died" in message
    assert "environment" not in message.replace("max_env_failure_share", "")
    with pytest.raises(RunStopped) as line, _naming_the_service(lambda: "the environment service at URL (log X)"):
        raise stopped.value
    assert "environment service" not in str(line.value) and "vLLM engine core died" in str(line.value)
