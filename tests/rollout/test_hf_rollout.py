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


# ---- batching: requests in flight together are generated together --------------------------------------------


@pytest.fixture(scope="module")
def serial_server(tiny_dir) -> HFRolloutServer:
    return HFRolloutServer(str(tiny_dir), HFServerConfig(prompt_length=64, response_length=12, seed=0, max_num_seqs=1))


@pytest.fixture(scope="module")
def prompts(tiny_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    questions = ["What is 2 + 2?", "Name a prime.", "List the files in the current directory, please.", "Hi"]
    return [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for q in questions
    ]


def _together(server: HFRolloutServer, requests: list[tuple[list[int], dict]]):
    """Submit every request before waiting for any (one batch), and check they were generated as one."""
    before = sum(server.batch_sizes.values())
    futures = [server.submit(prompt, params) for prompt, params in requests]
    outputs = [f.result(timeout=120) for f in futures]
    assert sum(server.batch_sizes.values()) - before < len(requests), "the requests were not batched"
    return outputs


def _one_at_a_time(server: HFRolloutServer, requests: list[tuple[list[int], dict]]):
    outputs = [server.generate_tokens(prompt, params) for prompt, params in requests]
    assert set(server.batch_sizes) == {1}
    return outputs


def test_greedy_batch_equals_one_at_a_time(server, serial_server, reference, prompts):
    # different prompt lengths (left padding), a repeated prompt (shared prefill), per-request limits and stops
    greedy_1 = _greedy_reference(reference, prompts[1], 10)
    stop = greedy_1[4]
    requests = [
        (prompts[0], {"temperature": 0, "max_tokens": 10, "logprobs": True}),
        (prompts[1], {"temperature": 0, "max_tokens": 10, "stop_token_ids": [stop], "logprobs": True}),
        (prompts[2], {"temperature": 0, "max_tokens": 3}),
        (prompts[0], {"temperature": 0, "max_tokens": 7, "logprobs": True}),
        (prompts[3], {"temperature": 0, "max_tokens": 10, "ignore_eos": True}),
    ]
    batched, serial = _together(server, requests), _one_at_a_time(serial_server, requests)
    assert [o.token_ids for o in batched] == [o.token_ids for o in serial]
    assert [len(o.token_ids) for o in batched] == [10, greedy_1.index(stop) + 1, 3, 7, 10]
    assert batched[1].token_ids == greedy_1[: greedy_1.index(stop) + 1]
    for b, s in zip(batched, serial):
        assert (b.log_probs is None) == (s.log_probs is None)
        if b.log_probs is not None:
            torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(s.log_probs), atol=1e-4, rtol=1e-4)
    # and both equal HF's own greedy decoding
    assert batched[0].token_ids == _greedy_reference(reference, prompts[0], 10)
    assert batched[2].token_ids == _greedy_reference(reference, prompts[2], 3)


def test_seeded_sampling_does_not_depend_on_the_batch(server, serial_server, prompts):
    # each request draws from its own generator: the same seed gives the same tokens alone or in any batch
    requests = [
        (prompts[i % 4], {"temperature": t, "top_k": k, "top_p": p, "max_tokens": 8, "seed": 100 + i, "logprobs": True})
        for i, (t, k, p) in enumerate([(1.0, -1, 1.0), (0.7, 50, 1.0), (1.0, -1, 0.9), (1.3, 20, 0.8), (0.5, -1, 1.0)])
    ]
    batched, serial = _together(server, requests), _one_at_a_time(serial_server, requests)
    assert [o.token_ids for o in batched] == [o.token_ids for o in serial]
    for b, s in zip(batched, serial):
        torch.testing.assert_close(torch.tensor(b.log_probs), torch.tensor(s.log_probs), atol=1e-4, rtol=1e-4)


def test_batched_sampled_logprobs_equal_forward_pass(server, reference, prompts):
    params = [{"temperature": 0.7, "top_k": 50, "logprobs": True, "max_tokens": 8, "seed": i} for i in range(4)]
    outputs = _together(server, list(zip(prompts, params)))
    for prompt, out in zip(prompts, outputs):
        expected = _forward_logprobs(reference, prompt, out.token_ids, 0.7, 50)
        torch.testing.assert_close(torch.tensor(out.log_probs), expected, atol=1e-4, rtol=1e-4)


def test_batched_first_tokens_follow_the_model_distribution(server, reference, prompts):
    # 400 first tokens drawn in batches (top-k 5: five outcomes) against the exact probabilities: a chi-square
    # statistic below the 0.1 % critical value for 4 degrees of freedom (fixed seeds: the outcome is reproducible)
    prompt, k, n = prompts[0], 5, 400
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, -1].float()
    top = torch.topk(logits, k)
    probs = torch.softmax(top.values, dim=-1)
    params = [{"temperature": 1.0, "top_k": k, "max_tokens": 1, "seed": 1000 + i} for i in range(n)]
    firsts = [o.token_ids[0] for o in _together(server, [(prompt, p) for p in params])]
    counts = torch.tensor([firsts.count(int(t)) for t in top.indices], dtype=torch.float)
    assert counts.sum() == n
    chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    assert chi2 < 18.47, (counts.tolist(), (n * probs).tolist())


def test_repetition_penalty_matches_hf_generate(server, reference, prompts):
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10, repetition_penalty=1.5,
            eos_token_id=[151643, 151645], pad_token_id=151643,
        )[0, ids.shape[1] :].tolist()  # fmt: skip
    requests = [(prompts[2], {"temperature": 0, "max_tokens": 10, "repetition_penalty": 1.5}), (prompts[0], {})]
    assert _together(server, requests)[0].token_ids == expected


def test_a_bad_request_fails_alone_before_it_is_queued(server, prompts):
    vocab = server.model.config.vocab_size
    with pytest.raises(ValueError, match="each in"):
        server.submit([1, vocab], {"temperature": 0})
    with pytest.raises(ValueError, match="at least one token"):
        server.submit([], {"temperature": 0})
    assert len(server.generate_tokens(prompts[0], {"temperature": 0, "max_tokens": 2}).token_ids) == 2
