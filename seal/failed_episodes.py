"""Episodes that could not run are not model failures; each carries the kind of what failed.

An episode that could not run comes back from the agent loop with ``seal_failed=True``, reward 0, an empty loss mask
and a kind (``seal_failure_kind``, one of :data:`FAILURE_KINDS`) with its first error (``seal_error``):

- ``environment``: the environment service (down after the retries, an unusable reply, no service on the node);
- ``generation``: the rollout server (a vLLM or Ray error out of ``generate``);
- ``agent_loop``: the agent loop itself (a token-merge error, a bug);
- ``task_data``: the task (an id the service does not know, a first prompt over ``rollout.prompt_length``).

Reward 0 would still be wrong twice over:

- in training it would enter its GRPO group's mean and standard deviation and shift every other member's
  advantage; the recipes' estimator, ``seal_grpo`` (``seal/advantage.py``), is verl's GRPO with every failed
  episode out of its group;
- in validation it would count as a wrong answer and could move the best checkpoint;
  ``split_validation_failures`` takes such tasks out of the accuracy and reports them apart, per kind;
- each kind has its own stop: when the share of a validation's or a training step's episodes that failed for one kind
  passes its threshold (``seal.validation.max_env_failure_share`` for the environment,
  ``seal.validation.max_other_failure_share`` for each other kind) the run stops, with a message that names the kind,
  the count and the first error (a broken service must not look like a bad model, nor a broken generation server like
  a broken service). A training step is stopped as its rollout returns (``stop_if_too_many_failed``): steps
  without a working rollout never pay for their log-probs (old and reference), never train, never become a checkpoint
  and never prune the last checkpoint made with a working one.

Both happen in ``SealAgentLoopManager`` (verl's agent-loop manager, set by the launcher): verl's ``fit`` calls its
``generate_sequences`` for a step's rollout, before anything else of the step, so no trainer method is overridden
for it. A training step in which every episode failed (and that the thresholds let through) has no token to train
on; the manager lets it run as a counted no-op instead of ending the run in verl's rollout-correction check, which
needs one trained token.
"""

from __future__ import annotations

import numpy as np
from verl.experimental.agent_loop import AgentLoopManager

from seal.resume import seed_samples

ENVIRONMENT, GENERATION, AGENT_LOOP, TASK_DATA = "environment", "generation", "agent_loop", "task_data"
FAILURE_KINDS = (ENVIRONMENT, GENERATION, AGENT_LOOP, TASK_DATA)
#: How a stop message says where the episodes failed.
WHERE = {
    ENVIRONMENT: "on the environment side",
    GENERATION: "in generation (the rollout server)",
    AGENT_LOOP: "in the agent loop",
    TASK_DATA: "on their task data",
}
#: ``reward_extra_info`` keys the agent loop sets on every trajectory (they reach validation per sample): 1.0 on a
#: failed episode, its kind ('' when it ran) and its first error.
FAILED_KEY, KIND_KEY, ERROR_KEY = "episode_failed", "failure_kind", "failure_error"
FAILURE_INFO_KEYS = (FAILED_KEY, KIND_KEY, ERROR_KEY)
#: Characters of the first error a stop message quotes.
ERROR_QUOTE_CHARS = 300


class TooManyFailedEpisodes(RuntimeError):
    """More episodes (of a validation, or of a training step) failed for one kind than its threshold allows."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # through Ray's pickling with its kind
        return type(self), (str(self), self.kind)


def failure_shares(validation_cfg) -> dict[str, float]:
    """``{kind: the largest share of failed episodes of that kind a validation or a step may have}``."""
    other = float(validation_cfg.max_other_failure_share)
    return {
        kind: float(validation_cfg.max_env_failure_share) if kind == ENVIRONMENT else other for kind in FAILURE_KINDS
    }


def share_key(kind: str) -> str:
    return "seal.validation." + ("max_env_failure_share" if kind == ENVIRONMENT else "max_other_failure_share")


def raise_if_too_many(kinds, errors, shares: dict[str, float], what: str, detail: str = "") -> None:
    """``TooManyFailedEpisodes`` when the share of episodes that failed for one kind passes its threshold.

    ``kinds``: each episode's failure kind ('' for one that ran); ``errors``: each episode's first error; ``what``:
    whose episodes. The message names the kind, the count and the first error of that kind.
    """
    kinds, errors = np.asarray(kinds, dtype=object), np.asarray(errors, dtype=object)
    total = len(kinds)
    for kind in FAILURE_KINDS:
        failed = kinds == kind
        share = float(failed.mean()) if total else 0.0
        if share > shares[kind]:
            first = " ".join(str(errors[failed][0]).split())[:ERROR_QUOTE_CHARS]
            raise TooManyFailedEpisodes(
                f"{what}: {int(failed.sum())} of {total} episodes failed {WHERE[kind]} (kind {kind}, share "
                f"{share:.3f} > {share_key(kind)}={shares[kind]}), e.g. {first!r}{detail}",
                kind,
            )


def failed_mask(batch) -> np.ndarray:
    return np.asarray(batch.non_tensor_batch["seal_failed"], dtype=bool)


def failure_kinds(batch) -> np.ndarray:
    """Each row's failure kind ('' for an episode that ran)."""
    return np.asarray(batch.non_tensor_batch["seal_failure_kind"], dtype=object)


def stop_if_too_many_failed(batch, step: int, shares: dict[str, float]) -> None:
    """Stop the run at training step ``step`` when too many of its episodes failed for one kind: called as the step's
    rollout returns, so such a step computes no log-probs, is not trained on and is not checkpointed."""
    if not failed_mask(batch).any():
        return
    detail = "; the run stops before the step's log-probs, update and checkpoint"
    errors = batch.non_tensor_batch["seal_error"]
    raise_if_too_many(failure_kinds(batch), errors, shares, f"training step {step}", detail)


def split_validation_failures(data_sources, sample_uids, infos: dict, sample_turns: list, shares: dict[str, float]):
    """Drop validation samples that could not run; report them per kind and per data source.

    Returns ``(data_sources, sample_uids, infos, sample_turns)`` without the failed samples (the arguments of
    verl's ``_val_metrics_update``) and the ``val-aux/failed_episodes/*`` metrics. Raises ``TooManyFailedEpisodes``
    when the share of one kind passes its threshold (``shares``: ``failure_shares``).
    """
    data_sources = np.asarray(data_sources)
    kinds = np.asarray(infos.get(KIND_KEY) or [""] * len(data_sources), dtype=object)
    failed = kinds != ""
    metrics = {
        "val-aux/failed_episodes/count": int(failed.sum()),
        "val-aux/failed_episodes/share": float(failed.mean()) if len(failed) else 0.0,
    }
    for kind in FAILURE_KINDS:
        metrics[f"val-aux/failed_episodes/{kind}/count"] = int((kinds == kind).sum())
    for source in sorted(set(data_sources[failed].tolist())):
        metrics[f"val-aux/failed_episodes/{source}/count"] = int((data_sources[failed] == source).sum())
    raise_if_too_many(kinds, infos.get(ERROR_KEY) or [""] * len(kinds), shares, "validation")
    keep = ~failed
    kept_infos = {
        k: [v for v, ok in zip(values, keep) if ok] for k, values in infos.items() if k not in FAILURE_INFO_KEYS
    }
    kept_uids = [u for u, ok in zip(sample_uids, keep) if ok]
    kept_turns = [np.concatenate(sample_turns)[keep]] if sample_turns else []
    return (data_sources[keep], kept_uids, kept_infos, kept_turns), metrics


class SealAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager; a training step with too many failed episodes of one kind stops the run as its
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
        stop_if_too_many_failed(output, step, failure_shares(self.config.seal.validation))
        if failed_mask(output).all():
            # verl's rollout correction (IS weights, mismatch metrics) needs one trained token; with none, the
            # step's update is a no-op over an all-zero mask and the failures are counted by the SEAL step
            output.batch.pop("rollout_log_probs", None)
        return output


__all__ = [
    "FAILED_KEY",
    "FAILURE_KINDS",
    "SealAgentLoopManager",
    "TooManyFailedEpisodes",
    "failed_mask",
    "failure_shares",
    "raise_if_too_many",
    "split_validation_failures",
    "stop_if_too_many_failed",
]
