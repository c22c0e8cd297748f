"""The ``scripted`` rollout backend (``seal/cpu/scripted_rollout.py``) answering the real agent loop over the real
environment (in-process): with no mistakes it plays the ground truth and every episode passes; with mistakes the
episodes fail in the ways their shares say, and the same seed answers the same."""

from __future__ import annotations

import asyncio

import pytest

from seal.cpu.scripted_rollout import ScriptConfig, ScriptedServer
from seal.resume import SEED_FIELD
from tests.support.agent_loop import make_config, make_loop

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
    server.config = ScriptConfig(wrong_argument=0, malformed=0, early_stop=0, extra_call=0, length_cut=0)
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


def test_a_ramble_is_cut_at_the_length_limit_without_its_end_of_turn_as_vllm_cuts_it(config, server, tokenizer):
    """Every answer rambling (``length_cut=1``): each generation is exactly the call's ``max_tokens`` long and has no
    end-of-turn token; the agent loop closes each such turn for the context without training on the closing token."""
    server.config = ScriptConfig(length_cut=1.0)
    out = run(config, tokenizer, server, TASKS[0], {SEED_FIELD: 5})
    assert not out.extra_fields["seal_failed"], out.extra_fields["seal_error"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns, current = [], []
    for token, mask in zip(out.response_ids, out.response_mask):
        if mask:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    assert turns and all(len(turn) == 1024 and turn[-1] != end for turn in turns[:-1]), [len(t) for t in turns]


def test_in_the_llama_format_a_tool_result_is_read_as_the_latest_message_not_the_question(tmp_path_factory):
    """Llama 3.1 puts tool results in ``ipython`` messages, not user ones: after the environment answered the turn's
    calls the script must read that answer (and end the turn), not answer the question before it again."""
    from seal.cpu.tiny_model import LLAMA31_CHAT_TEMPLATE, build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("llama") / "tiny", shape="bfcl_bpe_llama3")
    server = ScriptedServer(
        str(model), ScriptConfig(turn_start_token="<|start_header_id|>", end_of_turn_token="<|eot_id|>")
    )
    question = next(iter(server.by_question))
    asked = [{"role": "system", "content": "tools"}, {"role": "user", "content": question}]
    answered = [*asked, {"role": "assistant", "content": "[ls()]"}, {"role": "ipython", "content": '{"ls": []}'}]

    def turn(messages):
        prompt = server.tokenizer.apply_chat_template(
            messages, chat_template=LLAMA31_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True
        )
        return server.read(list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt))

    assert turn(asked).question == 0
    assert turn(answered).question is None and turn(answered).current == 0


def test_a_misspelt_setting_of_the_scripted_backend_is_refused_naming_the_real_one():
    from types import SimpleNamespace

    rollout = SimpleNamespace(custom={"scripted": {"length_cutt": 0.5}})
    with pytest.raises(ValueError, match=r"length_cutt \(did you mean length_cut\?\)"):
        ScriptConfig.from_rollout_config(rollout)
    assert ScriptConfig.from_rollout_config(SimpleNamespace(custom={"scripted": {"length_cut": 0.5}})).length_cut == 0.5
