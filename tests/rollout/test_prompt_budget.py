"""Every recipe's first prompts fit its prompt budget, and preflight refuses a recipe whose prompts do not.

The agent loop refuses an over-long first prompt instead of truncating it, so a prompt that grew past
``data.max_prompt_length`` (longer tool docs, schema cues, another prompt mode) would stop a run; these tests
catch it before a GPU does. Prompts are rendered by the environment service in-process and counted by
``seal.prompt_budget``: with the model's own tokenizer when ``model.path`` is a local directory, otherwise (hub
ids; no Llama-3.1 tokenizer can be downloaded offline) with the Qwen2.5 stand-in plus an explicit safety margin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from seal import prompt_budget
from seal.launch.preflight import preflight
from seal.launch.recipe import PreflightError, compose_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "exp").glob("*.yaml"))


def _cues_on(env_params: dict) -> dict:
    """The recipe's environment block with every train-only prompt addition on (the longest first prompts)."""
    return {
        **env_params,
        "observation_lite": {**env_params.get("observation_lite", {}), "enable": True},
        "capability_cues": {**env_params.get("capability_cues", {}), "enable": True},
    }


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_first_prompt_of_the_recipe_fits_its_budget_in_both_modes(recipe, monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name their data and local models relative to the repository root
    cfg = compose_recipe(str(recipe))
    files = [cfg.data.train_files, cfg.data.val_files]
    tasks = dict.fromkeys(task for task, _ in prompt_budget.run_episodes(files))  # 800 for the paper's recipes
    episodes = [(task, mode) for task in tasks for mode in ("train", "validate")]
    env = _cues_on(OmegaConf.to_container(cfg.env_service.bfcl, resolve=True))
    model = cfg.actor_rollout_ref.model
    longest = prompt_budget.longest(str(model.path), env, episodes, model.get("custom_chat_template"))
    budget = int(cfg.actor_rollout_ref.rollout.prompt_length)
    assert set(longest) == {"train", "validate"}
    for prompt in longest.values():
        assert prompt.required <= budget, f"{recipe.stem}: {prompt.describe()} > data.max_prompt_length {budget}"
    assert longest["train"].tokens > longest["validate"].tokens  # the train-only cues really are in the prompt


def test_preflight_refuses_a_recipe_whose_first_prompts_do_not_fit():
    # the released ToolACE recipe had the Qwen recipe's 8192 budget: its first prompts need ~9,600 with the margin
    cfg = compose_recipe(str(REPO / "exp" / "toolace2_8b.yaml"), ["data.max_prompt_length=8192"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    message = str(err.value)
    assert "first prompts do not fit data.max_prompt_length (8192)" in message
    assert "in train mode needs" in message and "in validate mode needs" in message
    assert "stand-in tokenizer" in message  # says the count is an estimate, and why
    # the check can be switched off (a long data set, a user who knows): then nothing about prompts is said
    off = compose_recipe(
        str(REPO / "exp" / "toolace2_8b.yaml"), ["data.max_prompt_length=8192", "seal.preflight.prompt_budget=false"]
    )
    try:
        preflight(off)
    except PreflightError as exc:
        assert "first prompts" not in str(exc)


def test_the_model_own_tokenizer_counts_exactly_and_the_stand_in_adds_its_margin(tiny_dir):
    env = OmegaConf.to_container(compose_recipe(str(REPO / "exp" / "SEAL.yaml")).env_service.bfcl, resolve=True)
    episodes = [("multi_turn_base_0", "train"), ("multi_turn_base_0", "validate")]
    own = prompt_budget.longest(str(tiny_dir), env, episodes)  # the tiny model ships the Qwen2.5 tokenizer
    hub = prompt_budget.longest("Qwen/Qwen2.5-7B-Instruct", env, episodes)
    for mode in ("train", "validate"):
        assert own[mode].exact and own[mode].required == own[mode].tokens
        assert not hub[mode].exact and hub[mode].tokens == own[mode].tokens  # same vocabulary, same template
        assert hub[mode].required >= hub[mode].tokens * 1.05 + 64


def test_piecewise_count_equals_a_direct_count(tokenizer):
    counter = prompt_budget.TokenCounter(tokenizer)
    env = _cues_on({"tool_prompt_mode": "toolace_llama"})
    for _, _, messages in prompt_budget.first_prompts(
        env, [("multi_turn_long_context_3", "train"), ("multi_turn_miss_func_7", "validate")]
    ):
        text = counter.render(messages)
        assert counter.pieces(text) == counter.direct(text) > 1000


def test_capability_cues_are_counted_at_their_longest():
    env = _cues_on({})
    profile = prompt_budget.worst_case_profile(env)
    assert len(profile["tags"]) == 3  # max_lines
    [(_, _, with_cues)] = prompt_budget.first_prompts(env, [("multi_turn_base_0", "train")], profile)
    [(_, _, without)] = prompt_budget.first_prompts(env, [("multi_turn_base_0", "train")])
    assert "Behavioral guidelines" in with_cues[0]["content"] and len(with_cues[0]["content"]) > len(
        without[0]["content"]
    )
