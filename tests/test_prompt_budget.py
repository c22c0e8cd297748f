"""Every BFCL prompt fits the recipe's prompt budget with the real Qwen tokenizer (train and validate modes).

The agent loop refuses an over-long first prompt instead of truncating it, so a prompt that grew past
``data.max_prompt_length`` (e.g. through schema cues) would stop a run; this catches it before a GPU does.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf  # noqa: E402

from env_service.config import EnvConfig  # noqa: E402
from env_service.episode import Episode  # noqa: E402
from env_service.tasks import load_task, task_ids  # noqa: E402
from seal.launch import compose_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_all_800_prompts_fit_the_seal_recipe_budget(tokenizer):
    recipe = compose_recipe(str(REPO / "exp" / "SEAL_interface_evolution.yaml"))
    budget = int(recipe.actor_rollout_ref.rollout.prompt_length)
    env = EnvConfig.from_dict(OmegaConf.to_container(recipe.env_service.bfcl, resolve=True))
    longest = {}
    for split, mode in (("train", "train"), ("heldout", "validate")):
        for task_id in task_ids(split):
            text = tokenizer.apply_chat_template(
                Episode(load_task(task_id), mode, env).initial_messages(), tokenize=False, add_generation_prompt=True
            )
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            longest[mode] = max(longest.get(mode, (0, "")), (n, task_id))
    assert longest["train"][0] <= budget, longest
    assert longest["validate"][0] <= budget, longest
    assert longest["train"][0] > longest["validate"][0]  # the train-only cues really are in the prompt
