"""The warm start's examples are the agent loop's token stream of a ground-truth episode, and a few steps on them
make the model more likely to produce the ground truth."""

from __future__ import annotations

import pytest

from env_service.bfcl.config import EnvConfig
from env_service.bfcl.episode import Episode
from env_service.bfcl.tasks import load_task
from env_service.replay import ground_truth_messages
from seal.cpu.warm_start import common_prefix_length, episode_tokens, shared_prefix_loss, warm_start

TASK = "multi_turn_base_100"  # two turns, one call each (exp/cpu_learning.yaml)
ENV = {"observation_lite": {"enable": True}}  # the train-only cues change the prompt: they must be in the examples


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    from seal.cpu.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("bpe") / "model", shape="bfcl_bpe")


@pytest.fixture(scope="module")
def tokenizer(bpe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bpe_dir)


def conversation(task_id: str, env: dict) -> tuple[list[dict], list[str]]:
    """The whole ground-truth conversation as chat messages (the environment's turns as user messages)."""
    task, config = load_task(task_id), EnvConfig.from_dict(env)
    episode = Episode(task, "train", config)
    messages, texts = episode.initial_messages(), ground_truth_messages(task, config.tool_prompt_mode)
    for text in texts:
        messages.append({"role": "assistant", "content": text})
        step = episode.step(text)
        if step.terminated:
            break
        messages.append({"role": "user", "content": step.message["content"]})
    episode.close()
    return messages, texts


def test_examples_are_the_chat_rendering_of_the_episode_with_the_model_turns_as_targets(tokenizer):
    ids, mask = episode_tokens(TASK, ENV, tokenizer, "qwen2")
    messages, texts = conversation(TASK, ENV)
    # one token stream for the whole episode, exactly the chat template's rendering of the conversation (the
    # agent loop stops after the last <|im_end|>, the template adds a newline)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ids) == rendered.removesuffix("\n")
    assert "[required]" in rendered  # the train-mode prompt
    targets, current = [], []
    for token, target in zip(ids, mask):
        if target:
            current.append(token)
        elif current:
            targets, current = [*targets, current], []
    targets.append(current)
    assert [tokenizer.decode(t) for t in targets] == [text + "<|im_end|>" for text in texts]


def test_warm_start_raises_the_likelihood_of_the_ground_truth_and_is_cached(bpe_dir, tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    ids, mask = episode_tokens(TASK, ENV, tokenizer, "qwen2")

    def target_nll(model_dir) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        picked = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return -float(picked[torch.tensor(mask[1:]) == 1].mean())

    out = warm_start(bpe_dir, tmp_path / "warm", [TASK], ENV, steps=8, lr=3e-3)
    assert target_nll(out) < target_nll(bpe_dir) - 1.0
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert warm_start(bpe_dir, tmp_path / "warm", [TASK], ENV, steps=8, lr=3e-3) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # the same spec is not trained again


def test_a_decoy_example_is_the_episode_of_the_wrong_first_call_with_its_real_replies(tokenizer):
    decoy = ('"NVDA"', '"MSFT"')  # exp/cpu_learning.yaml's decoy of this task
    ids, mask = episode_tokens(TASK, ENV, tokenizer, "qwen2")
    decoy_ids, decoy_mask = episode_tokens(TASK, ENV, tokenizer, "qwen2", decoy)
    text, decoy_text = tokenizer.decode(ids), tokenizer.decode(decoy_ids)
    # the model's first call asks for the other symbol, and the environment answers that call (not the right one)
    first_call = text.index('"symbol": "NVDA"')
    assert decoy_text[:first_call] == text[:first_call]
    assert decoy_text[first_call:].startswith('"symbol": "MSFT"')
    reply = text[text.index("<tool_response>") : text.index("</tool_response>")]
    decoy_reply = decoy_text[decoy_text.index("<tool_response>") : decoy_text.index("</tool_response>")]
    assert reply != decoy_reply and '"price"' in decoy_reply
    # the later turns are the ground truth's, still as targets
    targets = tokenizer.decode([t for t, m in zip(decoy_ids, decoy_mask) if m])
    assert "fund_account" in targets and "MSFT" in targets and "NVDA" not in targets
    assert sum(decoy_mask) - sum(mask) == len(tokenizer.encode("MSFT")) - len(tokenizer.encode("NVDA"))


def test_a_sampled_first_message_keeps_its_own_tokens_and_gets_its_real_replies(tokenizer):
    """``first_message``: the ids a policy generated (scripts/apatch_sampled.py) stand as the first message, and the
    environment answers their decoding."""
    ids, mask = episode_tokens(TASK, ENV, tokenizer, "qwen2")
    start = mask.index(1)
    end = start + mask[start:].index(0)
    right = ids[start:end]  # the ground truth's first message, its end-of-turn token included
    assert episode_tokens(TASK, ENV, tokenizer, "qwen2", first_message=right) == (ids, mask)
    # the same text in other (non-canonical) tokens: the episode keeps the given tokens, the replies are the same
    text = tokenizer.decode(right[:-1])
    split = [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)] + [right[-1]]
    assert split != right
    split_ids, split_mask = episode_tokens(TASK, ENV, tokenizer, "qwen2", first_message=split)
    assert split_ids[start : start + len(split)] == split and split_ids[start + len(split) :] == ids[end:]
    # a message the environment cannot parse is answered as such, and the rest of the episode follows it
    broken = tokenizer.encode("<tool_call>\n{oops", add_special_tokens=False) + [right[-1]]
    broken_ids, broken_mask = episode_tokens(TASK, ENV, tokenizer, "qwen2", first_message=broken)
    assert broken_ids[start : start + len(broken)] == broken and broken_mask[start : start + len(broken)] == [1] * len(
        broken
    )
    assert broken_ids[start + len(broken) :] != ids[end:]


def test_a_decoy_must_name_text_of_the_first_call_and_a_warm_start_task(bpe_dir, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="not in the first ground-truth message"):
        episode_tokens(TASK, ENV, tokenizer, "qwen2", ("AAPL", "GOOG"))
    with pytest.raises(ValueError, match="not warm-start tasks"):
        warm_start(bpe_dir, tmp_path / "warm", [TASK], ENV, 1, 3e-3, decoys={"multi_turn_base_144": ["a", "b"]})
    with pytest.raises(ValueError, match=r"must be \[old, new, ...\] strings"):
        warm_start(bpe_dir, tmp_path / "warm", [TASK], ENV, 1, 3e-3, decoys={TASK: ['"NVDA"']})


def test_the_shared_prefix_loss_equals_the_loss_and_gradients_of_each_example_on_its_own(bpe_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    right, *wrong = ['"NVDA"', '"MSFT"', '"TSLA"']  # a task's ground truth and two decoys: one prefix, three suffixes
    examples = [episode_tokens(TASK, ENV, tokenizer, "qwen2")]
    examples += [episode_tokens(TASK, ENV, tokenizer, "qwen2", (right, new)) for new in wrong]
    shared = common_prefix_length([ids for ids, _ in examples])
    assert 0.9 * len(examples[0][0]) < shared < len(examples[0][0])  # the prompt is nearly all of each episode
    model = AutoModelForCausalLM.from_pretrained(bpe_dir, dtype=torch.float32)

    def gradients():
        return [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    shared_loss = shared_prefix_loss(model, examples)
    shared_loss.backward()
    shared_grads = gradients()
    model.zero_grad()
    separate_loss = 0.0
    for ids, mask in examples:
        labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, labels[1:], reduction="sum", ignore_index=-100)
        loss.backward()
        separate_loss += loss.item()
    assert shared_loss.item() == pytest.approx(separate_loss, rel=1e-5)
    for a, b in zip(shared_grads, gradients(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5]]) == 2
    assert common_prefix_length([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix_length([[7], [8]]) == 0
