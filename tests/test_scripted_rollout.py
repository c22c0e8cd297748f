"""The ``scripted`` rollout backend (``seal/cpu/scripted_rollout.py``) answering the real agent loop over the real
environment (in-process): with no mistakes it plays the ground truth and every episode passes; with mistakes the
episodes fail in the ways their shares say, and the same seed answers the same."""

from __future__ import annotations

import asyncio

import pytest
from test_agent_loop import make_config, make_loop

from seal.cpu.scripted_rollout import ScriptConfig, ScriptedServer
from seal.resume import SEED_FIELD

#: Train tasks of three categories (a miss_func task shares its first question with its base variant).
TASKS = ("multi_turn_miss_func_121", "multi_turn_base_100", "multi_turn_long_context_144")


class Manager:
    """verl's server-manager interface over the scripted server."""

    def __init__(self, server):
        self.server = server

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.server.generate(prompt_ids=prompt_ids, sampling_params=sampling_params)


def run(config, tokenizer, server, task, seed=None):
    extra = {"task_id": task, "split": "train", "category": task.split("_", 2)[2].rsplit("_", 1)[0]}

    async def go():
        loop = make_loop(config, tokenizer, Manager(server))
        return await loop.run({"temperature": 1.0, "logprobs": True}, extra_info=extra, raw_prompt=[], **seed or {})

    return asyncio.run(go())


@pytest.fixture(scope="module")
def config():
    return make_config(
        **{"seal.rollout.max_model_calls": 20, "actor_rollout_ref.rollout.max_model_len": 32768},
        **{"actor_rollout_ref.rollout.response_length": 8192, "seal.rollout.max_tokens_per_call": 1024},
        **{"actor_rollout_ref.rollout.prompt_length": 8192},  # the recipe's: a long-context task's tools are long
    )


@pytest.fixture(scope="module")
def server(tiny_dir):
    return ScriptedServer(str(tiny_dir))


def test_without_mistakes_the_script_is_the_ground_truth(config, server, tokenizer):
    server.config = ScriptConfig(wrong_argument=0, malformed=0, early_stop=0, extra_call=0)
    for task in TASKS:
        out = run(config, tokenizer, server, task)
        assert out.reward_score == 1.0 and out.extra_fields["seal_termination"] == "completed", (task, out.extra_fields)
        # every turn passes; a missing-function turn by answering without a call
        assert out.extra_fields["seal_tags"] and set(out.extra_fields["seal_tags"]) <= {"pass", "correct_abstention"}


def test_mistakes_fail_episodes_with_the_tags_of_their_kind_and_a_seed_answers_the_same(config, server, tokenizer):
    server.config = ScriptConfig(wrong_argument=0.5, malformed=0.2, early_stop=0.2)
    episodes = [run(config, tokenizer, server, TASKS[1], {SEED_FIELD: seed}) for seed in range(6)]
    rewards = [out.reward_score for out in episodes]
    tags = {tag for out in episodes for tag in out.extra_fields["seal_tags"]}
    assert 0.0 in rewards and not any(out.extra_fields["seal_failed"] for out in episodes)
    assert tags - {"pass"}, tags  # mistakes the verifier names
    again = run(config, tokenizer, server, TASKS[1], {SEED_FIELD: 3})
    assert again.response_ids == episodes[3].response_ids
