"""``seal.eval checkpoint`` with the CPU recipe: the held-out prompts (up to 7,041 tokens, as docs/evaluation.md
says) do not fit the 4,096 tokens that recipe trains with, so the evaluation raises the budget to what the tasks
need; a budget the user sets stays theirs, and preflight says which keys to raise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from seal import prompt_budget
from seal.eval.checkpoint import CPU_RECIPE, eval_overrides, prompt_fit_overrides
from seal.eval.tasks import select_tasks, write_eval_dataset
from seal.launch.preflight import _check_prompt_budget
from seal.launch.recipe import compose_recipe

EVALUATION_MD = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


@pytest.fixture(scope="module")
def heldout_eval(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    val_file = write_eval_dataset(select_tasks("heldout", limit=1), str(out / "eval_tasks.parquet"))
    return eval_overrides(None, val_file, str(out / "results.jsonl"), str(out))


def prompt_problems(overrides) -> list[str]:
    problems = []
    _check_prompt_budget(compose_recipe(CPU_RECIPE, overrides), problems)
    return problems


def test_the_cpu_checkpoint_eval_fits_the_heldout_prompts(heldout_eval, capsys):
    assert prompt_problems(heldout_eval)  # the recipe's own budget refuses them
    raised = prompt_fit_overrides(CPU_RECIPE, heldout_eval)
    assert [o.split("=")[0] for o in raised] == ["data.max_prompt_length", "actor_rollout_ref.rollout.max_model_len"]
    assert prompt_problems(heldout_eval + raised) == []
    prompt, model_len = (int(o.split("=")[1]) for o in raised)
    assert model_len - prompt == 4608 - 4096  # the room after the prompt (response, environment messages) is kept
    assert "data.max_prompt_length=" in capsys.readouterr().out  # said, not silent


def test_a_budget_the_user_sets_is_kept_and_preflight_names_the_keys(heldout_eval):
    mine = [*heldout_eval, "data.max_prompt_length=4096"]
    assert prompt_fit_overrides(CPU_RECIPE, mine) == []
    (problem,) = prompt_problems(mine)
    assert "raise data.max_prompt_length" in problem and "actor_rollout_ref.rollout.max_model_len" in problem


def test_the_held_out_prompt_length_evaluation_md_states():
    """The task it names, rendered and counted with the CPU recipe's Qwen2.5 tokenizer, has the length it states, and
    the recipe's budget is the one it states."""
    text = EVALUATION_MD.read_text()
    stated = re.search(r"Held-out first prompts run to ([\d,]+) tokens \(`(\w+)`", text)
    config = compose_recipe(CPU_RECIPE)
    env = OmegaConf.to_container(config.env_service.bfcl, resolve=True)
    longest = prompt_budget.longest(str(config.actor_rollout_ref.model.path), env, [(stated[2], "validate")])
    assert f"{longest['validate'].tokens:,}" == stated[1]
    assert f"`exp/cpu_tiny.yaml`'s {config.data.max_prompt_length:,}" in text
