"""EnvConfig: defaults, strict validation (unknown keys, types), round trip, reward mapping."""

from __future__ import annotations

import pytest

from env_service.bfcl.config import EnvConfig, RewardConfig
from env_service.bfcl.prompts import OBSERVATION_NOTE

RECIPE_BLOCK = {  # exp/SEAL.yaml's env_service.bfcl (the released recipe's values)
    "strict_tool_parser": True,
    "enforce_available_tools": True,
    "tool_prompt_mode": "bfcl_qwen_fc",
    "tool_result_mode": "bfcl_tool_response",
    "observation_lite": {
        "enable": True,
        "apply_to_validation": False,
        "add_required_hint": True,
        "add_type_hint": False,
        "add_enum_hint": True,
        "hide_optional": False,
    },
}


def test_defaults():
    cfg = EnvConfig()
    assert cfg == EnvConfig.from_dict({}) == EnvConfig.from_dict(None)
    assert cfg.strict_tool_parser and cfg.enforce_available_tools
    assert (cfg.tool_prompt_mode, cfg.tool_result_mode) == ("bfcl_qwen_fc", "bfcl_tool_response")
    assert not cfg.observation_lite.enable and cfg.observation_lite.add_required_hint
    assert cfg.observation_lite.instruction == OBSERVATION_NOTE
    assert cfg.tool_feedback_evolution.max_tool_names == 12
    cues = cfg.capability_cues
    thresholds = (cues.min_tag_count, cues.prevalence_threshold, cues.reward_threshold, cues.max_lines)
    assert thresholds == (8, 0.10, 0.6, 3)
    assert cfg.reward.mode == "binary"


def test_recipe_block_round_trip():
    cfg = EnvConfig.from_dict(RECIPE_BLOCK)
    assert cfg.observation_lite.enable
    assert EnvConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["observation_lite"]["categories"] is None


@pytest.mark.parametrize(
    "block, message",
    [
        ({"strict_parser": True}, "unknown config key 'strict_parser'; allowed keys: capability_cues, "),
        (
            {"observation_lite": {"enabel": True}},
            "unknown config key 'enabel' in 'observation_lite'; allowed keys: add_enum_hint, "
            "add_required_hint, add_type_hint, apply_to_validation, categories, enable, hide_optional, instruction",
        ),
        ({"capability_cues": {"x": 1, "y": 2}}, "unknown config keys 'x', 'y' in 'capability_cues'"),
    ],
)
def test_unknown_keys(block, message):
    with pytest.raises(ValueError) as info:
        EnvConfig.from_dict(block)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "block, fragment",
    [
        ({"strict_tool_parser": 1}, "config key 'strict_tool_parser': expected a boolean, got int 1"),
        ({"strict_tool_parser": "true"}, "expected a boolean"),
        ({"tool_prompt_mode": "qwen"}, "'tool_prompt_mode': expected one of bfcl_qwen_fc, toolace_llama"),
        ({"tool_result_mode": None}, "config key 'tool_result_mode': expected one of"),
        ({"observation_lite": True}, "observation_lite: expected a mapping, got bool"),
        ({"observation_lite": {"categories": [1]}}, "config key 'observation_lite.categories'"),
        ({"observation_lite": {"instruction": 3}}, "expected a string"),
        ({"tool_feedback_evolution": {"max_tool_names": -1}}, "must be >= 0"),
        ({"tool_feedback_evolution": {"max_tool_names": 2.5}}, "expected an integer"),
        ({"capability_cues": {"prevalence_threshold": 1.5}}, "must be within [0.0, 1.0]"),
        ({"capability_cues": {"reward_threshold": float("nan")}}, "must not be NaN"),
        ({"capability_cues": {"min_tag_count": True}}, "expected an integer, got bool"),
        ({"capability_cues": {"guidelines": {"a": 1}}}, "entries must be tag -> text or null"),
        ({"reward": {"mode": "dense"}}, "config key 'reward.mode': expected one of binary, capped, t3rl"),
        ({"reward": {"partial_credit_cap": "0.5"}}, "expected a number"),
    ],
)
def test_wrong_types(block, fragment):
    with pytest.raises(ValueError) as info:
        EnvConfig.from_dict(block)
    assert fragment in str(info.value)


def test_categories_forms_and_replace():
    cfg = EnvConfig.from_dict({"observation_lite": {"categories": "base"}})
    assert cfg.observation_lite.categories == ("base",)
    assert cfg.observation_lite.replace(enable=True).enable
    with pytest.raises(ValueError):
        cfg.observation_lite.replace(enable="yes")


def test_reward_block_is_the_verifiers_reward_config():
    reward = RewardConfig.from_dict(
        {"mode": "capped", "partial_credit_cap": 0.0, "irrelevance_weight": 1}, path="reward"
    )
    assert (reward.mode, reward.partial_credit_cap, reward.irrelevance_weight) == ("capped", 0.0, 1.0)
    assert EnvConfig().reward == RewardConfig()
    with pytest.raises(ValueError, match="'cap_decay'"):  # an epoch-dependent cap nothing could set is gone
        RewardConfig.from_dict({"cap_decay": True}, path="reward")
