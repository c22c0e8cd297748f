"""The CPU recipe's agent-loop config (in-process environment, short limits) and a ``BfclAgentLoop`` built outside
verl's workers."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from seal.agent_loop import BfclAgentLoop
from seal.launch.recipe import compose_recipe

REPO = Path(__file__).resolve().parents[2]


def make_config(**overrides):
    cfg = compose_recipe(
        str(REPO / "exp" / "cpu_tiny.yaml"),
        [
            "env_service.url=inprocess",
            "actor_rollout_ref.rollout.response_length=256",
            "seal.rollout.max_tokens_per_call=24",
            "actor_rollout_ref.rollout.max_model_len=4352",
            "seal.rollout.max_env_tokens=256",
            *[f"{k}={v}" for k, v in overrides.items()],
        ],
    )
    OmegaConf.resolve(cfg)
    return cfg


def make_loop(config, tokenizer, server) -> BfclAgentLoop:
    return BfclAgentLoop.outside_workers(config, tokenizer, server, hf_model_type="qwen2")
