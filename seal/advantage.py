"""The recipes' advantage estimator, ``algorithm.adv_estimator: seal_grpo``: verl's GRPO with every episode that
could not run (``seal/failed_episodes.py``) out of its group.

Registered with verl's ``register_adv_est`` when verl loads seal's plugin (``seal/verl_plugins.py``, at the end of
``import verl`` in every process), so verl's own ``compute_advantage`` in ``fit`` computes it: the advantages are
computed once, where verl computes them, in any trainer that runs the recipe (``SealTrainer`` or verl's own).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, register_adv_est

#: ``algorithm.adv_estimator`` of the recipes: verl's GRPO with failed episodes out of their groups.
SEAL_GRPO = "seal_grpo"


@register_adv_est(SEAL_GRPO)
def grpo_without_failed(token_level_rewards, response_mask, index, config=None, **_):
    """verl's GRPO advantages (``compute_grpo_outcome_advantage``, called as verl calls it for ``grpo``) with every
    episode that could not run in a group of its own.

    A failed episode is the row with no token in the loss: the agent loop gives it an empty loss mask (and so does
    verl's sequence-level rollout rejection, when a recipe turns it on: a sequence it rejects whole is not trained and
    is left out of the baseline too). Alone in its group it gets advantage 0 (reward 0, mean 0), and the other members
    of its original group get the statistics of the group without it; groups without one are verl's GRPO exactly.
    A group left with one usable member has nothing to compare it with: verl would give that lone survivor mean 0 and
    std 1, i.e. its raw reward as advantage (which A-Patch could then scale up), so it gets 0.
    """
    failed = (response_mask.sum(dim=-1) == 0).cpu().numpy()
    uids = np.array(index, dtype=object)
    groups = uids.copy()
    groups[failed] = [f"seal-failed-{i}" for i in np.flatnonzero(failed)]
    advantages, returns = compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        index=groups,
        norm_adv_by_std_in_grpo=True if config is None else bool(config.get("norm_adv_by_std_in_grpo", True)),
    )
    if failed.any():
        lone = lone_survivors(uids, failed)
        advantages[lone] = 0.0
        returns[lone] = 0.0
    return advantages, returns


def lone_survivors(uids: np.ndarray, failed: np.ndarray) -> torch.Tensor:
    """Rows that are the only usable member of a group that lost members to failed episodes."""
    survivors = Counter(uids[~failed].tolist())
    lost = set(uids[failed].tolist())
    return torch.as_tensor([not f and u in lost and survivors[u] < 2 for u, f in zip(uids.tolist(), failed)])
