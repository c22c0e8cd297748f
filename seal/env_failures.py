"""Episodes the environment service could not run are not model failures.

An episode that failed on the environment side (service down after retries, unknown task, a first prompt that
does not fit) comes back from the agent loop with ``seal_failed=True``, reward 0 and an empty loss mask. Reward 0
would still be wrong twice over:

- in training it would enter its GRPO group's mean and standard deviation and shift every other member's
  advantage; ``regroup_without_failed`` recomputes the group statistics as if the failed episode were absent;
- in validation it would count as a wrong answer and could move the best checkpoint;
  ``split_validation_failures`` takes such tasks out of the accuracy, reports them apart, and stops the run when
  their share passes ``seal.validation.max_env_failure_share`` (a broken service must not look like a bad model);
- a training step whose failed share passes the same threshold stops the run there (``stop_if_environment_down``),
  as its rollout returns: steps without an environment never pay for their log-probs (old and reference), never
  train, never become a checkpoint and never prune the last checkpoint made with a live one.

Both happen in ``SealAgentLoopManager`` (verl's agent-loop manager, set by the launcher): verl's ``fit`` calls its
``generate_sequences`` for a step's rollout, before anything else of the step, so no trainer method is overridden
for it. A training step in which every episode failed (and that the threshold lets through) has no token to train
on; the manager lets it run as a counted no-op instead of ending the run in verl's rollout-correction check, which
needs one trained token.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from verl.experimental.agent_loop import AgentLoopManager
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from seal.resume import seed_samples

#: ``reward_extra_info`` key the agent loop sets to 1.0 on a failed episode (it reaches validation per sample).
FAILED_KEY = "env_failed"


class TooManyEnvFailures(RuntimeError):
    """More episodes (of a validation, or of a training step) failed on the environment side than the configured
    share allows."""


def raise_if_too_many(failed: np.ndarray, max_share: float, what: str, detail: str = "") -> None:
    """``TooManyEnvFailures`` when the share of ``failed`` passes ``max_share`` (``what``: whose episodes)."""
    share = float(failed.mean()) if len(failed) else 0.0
    if share > max_share:
        raise TooManyEnvFailures(
            f"{what}: {int(failed.sum())} of {len(failed)} episodes failed on the environment side (share {share:.3f} "
            f"> seal.validation.max_env_failure_share={max_share}){detail}"
        )


def failed_mask(batch) -> np.ndarray:
    return np.asarray(batch.non_tensor_batch["seal_failed"], dtype=bool)


def regroup_without_failed(batch, norm_adv_by_std: bool) -> int:
    """Recompute verl's GRPO advantages with every failed episode moved into a group of its own.

    verl's ``compute_grpo_outcome_advantage`` is called exactly as verl calls it, only with a different group
    index: a failed episode alone in its group gets advantage 0 (reward 0, mean 0), and the other members of its
    original group get the statistics of the group without it. Groups without failures are unchanged.
    A group left with one usable member has nothing to compare it with: verl would give that lone survivor
    mean 0 and std 1, i.e. its raw reward as advantage (which A-Patch could then scale up), so it gets 0.
    Returns the number of failed episodes.
    """
    failed = failed_mask(batch)
    if not failed.any():
        return 0
    uids = np.array(batch.non_tensor_batch["uid"], dtype=object)
    index = uids.copy()
    index[failed] = [f"seal-env-failed-{i}" for i in np.flatnonzero(failed)]
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["token_level_rewards"],
        response_mask=batch.batch["response_mask"],
        index=index,
        norm_adv_by_std_in_grpo=norm_adv_by_std,
    )
    lone = lone_survivors(uids, failed)
    advantages[lone] = 0.0
    returns[lone] = 0.0
    batch.batch["advantages"] = advantages
    batch.batch["returns"] = returns
    return int(failed.sum())


def stop_if_environment_down(batch, step: int, max_share: float) -> None:
    """Stop the run at training step ``step`` when the environment failed too many of its episodes: called as the
    step's rollout returns, so such a step computes no log-probs, is not trained on and is not checkpointed."""
    failed = failed_mask(batch)
    if not failed.any():
        return
    errors = sorted({str(e) for e in np.asarray(batch.non_tensor_batch["seal_error"])[failed]})
    first = " ".join(errors[0].split())[:200] if errors else ""
    detail = f", e.g. {first!r}; the run stops before the step's log-probs, update and checkpoint"
    raise_if_too_many(failed, max_share, f"training step {step}", detail)


def lone_survivors(uids: np.ndarray, failed: np.ndarray) -> torch.Tensor:
    """Rows that are the only usable member of a group that lost members to environment failures."""
    survivors = Counter(uids[~failed].tolist())
    lost = set(uids[failed].tolist())
    return torch.as_tensor([not f and u in lost and survivors[u] < 2 for u, f in zip(uids.tolist(), failed)])


def split_validation_failures(data_sources, sample_uids, infos: dict, sample_turns: list, max_share: float):
    """Drop validation samples that failed on the environment side; report them per data source.

    Returns ``(data_sources, sample_uids, infos, sample_turns)`` without the failed samples (the arguments of
    verl's ``_val_metrics_update``) and the ``val-aux/env_failed/*`` metrics. Raises ``TooManyEnvFailures``
    when the failed share exceeds ``max_share``.
    """
    data_sources = np.asarray(data_sources)
    flags = infos.get(FAILED_KEY) or [0.0] * len(data_sources)
    failed = np.asarray(flags, dtype=float) > 0
    metrics = {
        "val-aux/env_failed/count": int(failed.sum()),
        "val-aux/env_failed/share": float(failed.mean()) if len(failed) else 0.0,
    }
    for source in sorted(set(data_sources[failed].tolist())):
        metrics[f"val-aux/env_failed/{source}/count"] = int((data_sources[failed] == source).sum())
    raise_if_too_many(failed, max_share, "validation")
    keep = ~failed
    kept_infos = {k: [v for v, ok in zip(values, keep) if ok] for k, values in infos.items() if k != FAILED_KEY}
    kept_uids = [u for u, ok in zip(sample_uids, keep) if ok]
    kept_turns = [np.concatenate(sample_turns)[keep]] if sample_turns else []
    return (data_sources[keep], kept_uids, kept_infos, kept_turns), metrics


class SealAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager; a training step whose environment failed too many episodes stops the run as its
    rollout returns, and one in which every episode failed (within the share) trains nothing, as a no-op.
    Training samples get their seeds from the step here, before verl splits the batch among its workers
    (``seal/resume.py``, ``seal.rollout.step_seeds``)."""

    def generate_sequences(self, prompts):
        training = not prompts.meta_info.get("validate")
        if training and self.config.seal.rollout.step_seeds:
            seed_samples(prompts, int(self.config.actor_rollout_ref.rollout.seed))
        output = super().generate_sequences(prompts)  # verl's auto_await runs it to completion here
        if not training:
            return output
        step = int(prompts.meta_info.get("global_steps", 0))
        stop_if_environment_down(output, step, float(self.config.seal.validation.max_env_failure_share))
        if failed_mask(output).all():
            # verl's rollout correction (IS weights, mismatch metrics) needs one trained token; with none, the
            # step's update is a no-op over an all-zero mask and the failures are counted by the SEAL step
            output.batch.pop("rollout_log_probs", None)
        return output


__all__ = [
    "FAILED_KEY",
    "SealAgentLoopManager",
    "TooManyEnvFailures",
    "failed_mask",
    "regroup_without_failed",
    "raise_if_too_many",
    "split_validation_failures",
    "stop_if_environment_down",
]
