"""The `hf` CPU rollout server: greedy parity with HF, exact log-probs, stops, max_tokens, weight sync."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from seal.cpu.hf_rollout import HFRolloutServer, HFServerConfig, drain_named_tensors  # noqa: E402

CONFIG = HFServerConfig(prompt_length=64, response_length=12, seed=0)


@pytest.fixture(scope="module")
def server(tiny_dir) -> HFRolloutServer:
    return HFRolloutServer(str(tiny_dir), CONFIG)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_dir) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def _greedy_reference(model, prompt_ids, max_new_tokens, eos_ids=(151643, 151645)):
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(eos_ids),
            pad_token_id=151643,
        )
    return out[0, len(prompt_ids) :].tolist()


def _forward_logprobs(model, prompt_ids, token_ids, temperature=1.0, top_k=-1):
    """log p(token_t | prefix) from one teacher-forced forward pass (top-k: renormalized over the k best)."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def test_greedy_matches_hf_generate(server, reference, prompt_ids):
    out = server.generate_tokens(prompt_ids, {"temperature": 0.0, "max_tokens": 10})
    assert out.token_ids == _greedy_reference(reference, prompt_ids, 10)
    assert out.stop_reason == "completed" and out.log_probs is None


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, -1), (0.7, -1), (1.0, 50)])
def test_sampled_logprobs_equal_forward_pass(server, reference, prompt_ids, temperature, top_k):
    # processed_logprobs (verl's default): the distribution the token was drawn from
    params = {"temperature": temperature, "top_p": 1.0, "top_k": top_k, "logprobs": True, "max_tokens": 8, "seed": 3}
    out = server.generate_tokens(prompt_ids, params)
    assert len(out.token_ids) == len(out.log_probs) == 8
    expected = _forward_logprobs(reference, prompt_ids, out.token_ids, temperature, top_k)
    torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_is_reproducible(server, prompt_ids):
    params = {"temperature": 1.0, "max_tokens": 6, "seed": 11}
    assert server.generate_tokens(prompt_ids, params).token_ids == server.generate_tokens(prompt_ids, params).token_ids


def test_stop_token_ids_end_generation_inclusively(server, reference, prompt_ids):
    greedy = _greedy_reference(reference, prompt_ids, 10)
    stop = greedy[3]
    cut = greedy.index(stop) + 1
    out = server.generate_tokens(prompt_ids, {"temperature": 0, "max_tokens": 10, "stop_token_ids": [stop]})
    assert out.token_ids == greedy[:cut]


def test_eos_from_generation_config_stops_and_ignore_eos_continues(tmp_path, reference, prompt_ids):
    greedy = _greedy_reference(reference, prompt_ids, 10)
    fake_eos = greedy[2]
    reference.generation_config.eos_token_id = [fake_eos]
    try:
        reference.save_pretrained(tmp_path)  # same weights, EOS = a token greedy decoding emits
    finally:
        reference.generation_config.eos_token_id = [151645, 151643]
    eos_server = HFRolloutServer(str(tmp_path), CONFIG)
    assert fake_eos in eos_server.eos_ids
    stopped = eos_server.generate_tokens(prompt_ids, {"temperature": 0, "max_tokens": 10})
    assert stopped.token_ids == greedy[: greedy.index(fake_eos) + 1]
    continued = eos_server.generate_tokens(prompt_ids, {"temperature": 0, "max_tokens": 10, "ignore_eos": True})
    assert continued.token_ids == _greedy_reference(reference, prompt_ids, 10, eos_ids=())


def test_max_tokens_and_server_default(server, prompt_ids):
    assert len(server.generate_tokens(prompt_ids, {"temperature": 0, "max_tokens": 5}).token_ids) == 5
    assert len(server.generate_tokens(prompt_ids, {"temperature": 1, "max_new_tokens": 3}).token_ids) == 3
    # no max_tokens: min(response_length, prompt_length + response_length - len(prompt)), like vLLM
    assert len(server.generate_tokens(prompt_ids, {"temperature": 0, "ignore_eos": True}).token_ids) == 12
    assert server.resolve_max_tokens(70, {}) == 6  # 64 + 12 - 70
    assert server.resolve_max_tokens(75, {}) == 1  # never below one token
    capped = HFRolloutServer.__new__(HFRolloutServer)
    capped.config, capped.max_model_len = CONFIG, 50
    assert capped.resolve_max_tokens(45, {"max_tokens": 100}) == 5  # max_model_len wins
    with pytest.raises(ValueError):
        capped.resolve_max_tokens(50, {})


def test_weight_update_changes_outputs(tiny_dir, reference, prompt_ids):
    server = HFRolloutServer(str(tiny_dir), CONFIG)
    params = {"temperature": 0, "max_tokens": 10}
    before = server.generate_tokens(prompt_ids, params).token_ids
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in reference.state_dict().items()}
    assert server.load_state_dict(perturbed)["loaded"] == len(perturbed)
    after = server.generate_tokens(prompt_ids, params).token_ids
    assert after != before
    from transformers import AutoModelForCausalLM

    expected_model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()
    expected_model.load_state_dict(perturbed)
    assert after == _greedy_reference(expected_model, prompt_ids, 10)


def test_weight_update_rejects_unknown_names(server):
    with pytest.raises(ValueError, match="unexpected"):
        server.load_state_dict({"not.a.weight": torch.zeros(1)})


def test_drain_consumes_everything_and_keeps_only_on_leader():
    consumed = []

    def weights():
        for i in range(3):
            consumed.append(i)
            yield f"w{i}", torch.full((2,), float(i))

    assert drain_named_tensors(weights(), keep=False) is None and consumed == [0, 1, 2]
    kept = drain_named_tensors(weights(), keep=True)
    assert list(kept) == ["w0", "w1", "w2"] and torch.equal(kept["w2"], torch.full((2,), 2.0))


def test_async_server_api_and_lifecycle(server, prompt_ids):
    async def run():
        await server.set_global_steps(7)
        params = {"temperature": 0, "max_tokens": 2}
        out = await server.generate(
            request_id="r1", prompt_ids=prompt_ids, sampling_params=params, image_data=None, video_data=None
        )
        for name in (
            "wake_up",
            "sleep",
            "resume_generation",
            "clear_kv_cache",
            "release_kv_cache",
            "resume_kv_cache",
            "start_profile",
            "stop_profile",
        ):
            await getattr(server, name)()
        await server.abort_all_requests(reject_request=True)
        return out

    out = asyncio.run(run())
    assert len(out.token_ids) == 2 and out.extra_fields["global_steps"] == 7


def test_unsupported_sampling_params_are_rejected(server, prompt_ids):
    with pytest.raises(ValueError, match="unsupported"):
        server.generate_tokens(prompt_ids, {"temperature": 0, "stop": ["\n"]})
