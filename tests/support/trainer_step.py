"""A ``SealTrainer`` with only its SEAL parts (the CPU recipe, in-process environment) and a batch shaped like the
agent loop's output, with verl's GRPO advantages for reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.trainer.ppo.ray_trainer import compute_advantage

from seal.advantage import SEAL_GRPO
from seal.launch.recipe import compose_recipe
from seal.trainer import SealTrainer

REPO = Path(__file__).resolve().parents[2]


def make_trainer(tmp_path, *overrides, steps_per_epoch=2):
    cfg = compose_recipe(
        str(REPO / "exp" / "cpu_tiny.yaml"),
        [
            "env_service.url=inprocess",
            f"seal.run_dir={tmp_path}",
            f"seal.diagnosis.state_dir={tmp_path}/state",
            f"seal.diagnosis.dump_dir={tmp_path}/stats",
            f"trainer.default_local_dir={tmp_path}/ckpt",
            *overrides,
        ],
    )
    OmegaConf.resolve(cfg)
    return SealTrainer.seal_parts_only(cfg, steps_per_epoch)


def make_batch(rows, response_len=6):
    """rows: (uid, reward, tags, labels, failed)."""
    n = len(rows)
    mask = torch.ones(n, response_len)
    mask[:, -2:] = 0
    scores = torch.zeros(n, response_len)
    scores[:, 3] = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    for i, row in enumerate(rows):
        if row[4]:
            mask[i] = 0
    index = np.array([r[0] for r in rows], dtype=object)
    # the reference: GRPO over the episodes the environment could run (a failed one is a group of its own)
    alone = np.array([f"failed-{i}" if r[4] else r[0] for i, r in enumerate(rows)], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(scores, mask, alone)
    obj = lambda values: np.array(values + [None], dtype=object)[:-1]  # noqa: E731 - keep lists as objects
    batch = DataProto.from_dict(
        tensors={"token_level_scores": scores, "token_level_rewards": scores, "response_mask": mask},
        non_tensors={
            "uid": index,
            "seal_task_id": np.array([f"multi_turn_base_{r[0]}" for r in rows], dtype=object),
            "seal_category": np.array(["base"] * n, dtype=object),
            "seal_tags": obj([r[2] for r in rows]),
            "seal_labels": obj([r[3] for r in rows]),
            "seal_env_errors": obj([[] for _ in rows]),
            "seal_failed": np.array([r[4] for r in rows], dtype=object),
            "seal_termination": np.array(["completed"] * n, dtype=object),
            "seal_model_calls": np.array([3] * n, dtype=object),
            "seal_response_truncated": np.array([False] * (n - 1) + [True], dtype=object),
            "seal_error": np.array(["env down" if r[4] else "" for r in rows], dtype=object),
            "seal_failure_kind": np.array(["environment" if r[4] else "" for r in rows], dtype=object),
        },
    )
    # what verl's fit hands the trainer: the recipe's registered estimator, looked up by its name
    algorithm = OmegaConf.create({"adv_estimator": SEAL_GRPO, "norm_adv_by_std_in_grpo": True})
    return compute_advantage(batch, SEAL_GRPO, config=algorithm), advantages
