"""ToolACE-2-8B sees exactly what bfcl-eval shows it: the recipe's chat template and the environment's ipython
tool results reproduce bfcl's ``LlamaHandler`` prompt token for token, and a turn ends with ``<|eot_id|>``.

No Llama-3.1 tokenizer can be downloaded here, so a Llama-3.1-style tokenizer is built offline: the Qwen BPE with
Llama 3's header/turn special tokens, ``<|end_of_text|>`` as its eos (as a Llama-3.1 base tokenizer has) and the
recipe's chat template. The expected strings come from bfcl-eval's own handler code.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from bfcl_eval.model_handler.local_inference.llama import LlamaHandler
from omegaconf import OmegaConf

from env_service.client import InProcessEnvClient
from seal.agent_loop import BfclAgentLoop
from seal.cpu.scripted_rollout import FixedReplies
from seal.launch.recipe import compose_recipe

REPO = Path(__file__).resolve().parents[2]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TASK = "multi_turn_base_107"  # turn 1 asks for a stock price: one call, one result


@pytest.fixture(scope="module")
def config():
    cfg = compose_recipe(str(REPO / "exp" / "toolace2_8b.yaml"), ["env_service.url=inprocess"])
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture(scope="module")
def llama_tokenizer(config):
    from seal.cpu.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS}, replace_extra_special_tokens=False)
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|end_of_text|>"
    tok.chat_template = config.actor_rollout_ref.model.custom_chat_template
    return tok


def bfcl_prompt(messages: list[dict]) -> str:
    """bfcl-eval's Llama-3 prompt for ``messages`` (its ``_format_prompt``, called on the handler class)."""
    handler = LlamaHandler.__new__(LlamaHandler)
    handler.model_name = "Team-ACE/ToolACE-2-8B"
    return handler._format_prompt(messages, function=None)


def bfcl_history_with_results(messages: list[dict], results: list[str]) -> list[dict]:
    handler = LlamaHandler.__new__(LlamaHandler)
    data = {"message": list(messages)}
    return handler._add_execution_results_prompting(data, results, {})["message"]


def run_loop(config, tokenizer, server):
    async def go():
        loop = BfclAgentLoop.outside_workers(config, tokenizer, server, hf_model_type="llama")
        params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
        extra = {"task_id": TASK, "split": "val", "category": "base"}
        return await loop.run(params, extra_info=extra, raw_prompt=[])

    return asyncio.run(go())


def test_first_prompt_is_bfcl_llama_prompt_token_for_token(config, llama_tokenizer):
    created = InProcessEnvClient().create(TASK, "validate", OmegaConf.to_container(config.env_service.bfcl))
    messages = created["messages"]
    ids = llama_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert llama_tokenizer.decode(ids) == bfcl_prompt(messages)
    assert "Cutting Knowledge Date" not in llama_tokenizer.decode(ids)


@pytest.mark.parametrize(
    "call", ["[get_stock_info(symbol='ZETA')]", "[get_stock_info(symbol='ZETA'), get_stock_info(symbol='AAPL')]"]
)
def test_tool_results_come_back_as_ipython_turns_and_turns_end_with_eot(config, llama_tokenizer, call):
    server = FixedReplies(llama_tokenizer, [call, ""], end="<|eot_id|>")
    out = run_loop(config, llama_tokenizer, server)
    assert len(server.prompts) >= 2
    first = llama_tokenizer.decode(server.prompts[0])
    second = llama_tokenizer.decode(server.prompts[1])
    # what bfcl shows the model after its call: the history, the call as an assistant turn, each result as ipython
    created = InProcessEnvClient().create(TASK, "validate", OmegaConf.to_container(config.env_service.bfcl))
    result_text = second[len(first) + len(call) + len("<|eot_id|>") :]
    assert result_text.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n")
    results = [
        part.split("<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>")[0]
        for part in result_text.split("<|start_header_id|>ipython")[1:]
    ]
    history = bfcl_history_with_results(created["messages"] + [{"role": "assistant", "content": call}], results)
    assert second == bfcl_prompt(history)
    assert len(results) == call.count("get_stock_info(")  # one ipython turn per result, as bfcl sends them
    assert all("price" in result for result in results)  # real TradingBot results, not error texts
    # the model's own <|eot_id|> closed its turn: nothing was inserted (every response token after the call is env)
    assert out.extra_fields["seal_response_truncated"] is False
    eot = llama_tokenizer.convert_tokens_to_ids("<|eot_id|>")
    first_turn = out.response_ids[: len(llama_tokenizer.encode(call, add_special_tokens=False)) + 1]
    assert first_turn[-1] == eot and all(out.response_mask[: len(first_turn)])
