"""Supervised warm start of a tiny CPU model on ground-truth episodes, so that GRPO has something to improve.

A random tiny model never solves a BFCL turn, so every reward is 0 and GRPO has no signal. A few supervised
steps on the ground-truth episodes of the recipe's train tasks bring it to where sampled episodes solve the
task only sometimes; from there GRPO can move the reward (``exp/cpu_learning.yaml``, ``scripts/learning_check.py``).

The examples are what the agent loop will see: the environment renders each episode (its train-mode prompt and
its replies to the ground-truth calls, ``env_service.bfcl.episode.Episode``, the code the service runs) and verl's
continuous-token builder for the model's ``model_type`` turns it into token ids exactly as ``seal/agent_loop.py``
does: the generated turns (the ground-truth text plus ``<|im_end|>``) are the targets, the environment's tokens
(and the newline the builder inserts after ``<|im_end|>``) are context.

The loop is a plain transformers/PyTorch one rather than verl's SFT trainer: verl's trainer wants a torchrun
launch, its own parquet layout of chat messages that it re-tokenizes with the chat template (not the agent loop's
token stream), and a device mesh; for a handful of sequences and a model of a few hundred thousand parameters a
short loop is exact and takes a minute or two. A task's examples (its ground truth and its decoys) share the long
prompt, which runs once per step for all of them (``shared_prefix_loss``).

The result is cached like the tiny model: a spec file next to the weights names everything that made them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

SPEC_FILE = "seal_warm_start.json"
SPEC_VERSION = 3


def episode_tokens(
    task_id: str,
    env_params: dict,
    tokenizer,
    model_type: str,
    decoy: tuple[str, str] | None = None,
    first_message: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = a token the model generates) of the ground-truth episode of ``task_id``; with
    ``decoy = (old, new)``, of the episode whose first call has ``old`` replaced by ``new`` (the environment's
    replies are the ones that wrong call really gets). ``first_message``: token ids a policy generated for the first
    message (its end-of-turn token included), in place of the first ground-truth message; the environment reads
    their decoding, as the agent loop's (special tokens skipped)."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from env_service.bfcl.config import EnvConfig
    from env_service.bfcl.episode import Episode
    from env_service.bfcl.tasks import load_task
    from env_service.vocabulary import MODE_TRAIN

    config = EnvConfig.from_dict(env_params)
    builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)
    task = load_task(task_id)
    episode = Episode(task, MODE_TRAIN, config)
    try:
        messages = episode.initial_messages()
        ids = list(builder.build_initial_tokens(messages))
        mask = [0] * len(ids)
        texts = list(episode_texts(task, config.tool_prompt_mode, decoy))
        if first_message is not None:
            texts[0] = tokenizer.decode(first_message, skip_special_tokens=True)
        for i, text in enumerate(texts):
            if i == 0 and first_message is not None:
                generated = list(first_message)
            else:
                generated = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            ids += generated
            mask += [1] * len(generated)
            step = episode.step(text)
            if step.terminated:
                break
            # as the agent loop: the assistant message joins the history when generated (its tokens are already
            # in ``ids``), then the reply is appended as a user turn (the recipe's bfcl_tool_response mode)
            previous = [*messages, {"role": "assistant", "content": text}]
            messages = [*previous, {"role": "user", "content": step.message["content"]}]
            merged = builder.merge_context_tokens(previous, messages, ids)
            mask += [0] * (len(merged.token_ids) - len(ids))
            ids = list(merged.token_ids)
    finally:
        episode.close()
    return ids, mask


def episode_texts(task, tool_prompt_mode: str, decoy: tuple[str, str] | None = None) -> list[str]:
    """The model's messages of the ground-truth episode of ``task`` (its calls, then "Done.", per turn); with
    ``decoy = (old, new)``, with ``old`` replaced by ``new`` in the first one."""
    from env_service.replay import ground_truth_messages

    texts = ground_truth_messages(task, tool_prompt_mode)
    if not decoy:
        return texts
    old, new = decoy
    if old not in texts[0]:
        raise ValueError(f"decoy {old!r} is not in the first ground-truth message of {task.id}: {texts[0]!r}")
    return [texts[0].replace(old, new), *texts[1:]]


def shared_prefix_loss(model, examples: list[tuple[list[int], list[int]]]):
    """Summed next-token cross-entropy of the examples' targets (mask 1), as if each ran on its own, with the
    prefix they all share run once: a task's decoys differ from its ground truth only from the first call's choice
    on, and the prompt before it is ~95 % of their tokens. The prefix's keys and values are reused for every
    suffix and its targets count once per example; gradients flow through the shared prefix as through each
    example's own copy (causal attention: a prefix never sees what follows it)."""
    import torch
    from torch.nn.functional import cross_entropy

    def targets(ids, mask):
        return torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])

    shared = common_prefix_length([ids for ids, _ in examples])
    shared = min(shared, min(len(ids) for ids, _ in examples) - 1)  # each example keeps a suffix of its own
    ids0, mask0 = examples[0]  # the same tokens up to ``shared``, hence the same targets there
    out = model(input_ids=torch.tensor([ids0[:shared]]), use_cache=True)
    prefix_logits, cache = out.logits[0], out.past_key_values
    loss = len(examples) * cross_entropy(
        prefix_logits[:-1], targets(ids0[1:shared], mask0[1:shared]), reduction="sum", ignore_index=-100
    )
    for ids, mask in examples:
        suffix_logits = model(input_ids=torch.tensor([ids[shared:]]), past_key_values=cache, use_cache=True).logits[0]
        logits = torch.cat([prefix_logits[-1:], suffix_logits[:-1]])  # the prefix's last position predicts ids[shared]
        loss = loss + cross_entropy(logits, targets(ids[shared:], mask[shared:]), reduction="sum", ignore_index=-100)
        cache.crop(shared)  # back to the shared prefix for the next example (slices: autograd sees no change)
    return loss


def fit_examples(model, groups: list[list[tuple[list[int], list[int]]]], steps: int, lr: float) -> float:
    """``steps`` full-batch AdamW steps (no weight decay) of the token-mean loss over every example of every group
    (a group: examples that share their prefix, run once by ``shared_prefix_loss``); returns the last loss. The
    token tensors are made on torch's default device (``with torch.device(...)`` to train elsewhere)."""
    import torch

    token_count = sum(sum(mask) for group in groups for _, mask in group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_sum = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        loss_sum = 0.0
        for group in groups:  # one task at a time: the token-mean over all examples of all tasks
            loss = shared_prefix_loss(model, group)
            (loss / token_count).backward()
            loss_sum += loss.item()
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"[warm start] step {step + 1}/{steps} loss {loss_sum / token_count:.4f}", flush=True)
    model.eval()
    return loss_sum / token_count


def common_prefix_length(sequences: list[list[int]]) -> int:
    length = min(len(s) for s in sequences)
    for i in range(length):
        if any(s[i] != sequences[0][i] for s in sequences[1:]):
            return i
    return length


def warm_start_spec(
    base_dir: Path, tasks: list[str], env_params: dict, steps: int, lr: float, seed: int, decoys: dict
) -> dict:
    base_spec = (base_dir / "seal_tiny_model.json").read_text() if (base_dir / "seal_tiny_model.json").exists() else ""
    return {
        "spec_version": SPEC_VERSION,
        "base_model_spec_sha": hashlib.sha256(base_spec.encode()).hexdigest()[:16],
        "tasks": list(tasks),
        "decoys": {task: list(texts) for task, texts in decoys.items()},
        "env_params_sha": hashlib.sha256(json.dumps(env_params, sort_keys=True).encode()).hexdigest()[:16],
        "steps": steps,
        "lr": lr,
        "seed": seed,
    }


def build_recipe_model(config) -> None:
    """A CPU recipe's tiny model (``seal.tiny_model`` with ``build``), built offline at its ``out_dir``, then
    warm-started at ``warm_start.out_dir`` when the recipe names one (supervised steps on the ground-truth episodes
    of its tasks in the recipe's environment, ``env_service.bfcl``). Both are cached: a call with the same spec
    returns at once."""
    tiny = config.seal.get("tiny_model")
    if not (tiny and tiny.get("build")):
        return
    from omegaconf import OmegaConf

    from seal.cpu.tiny_model import build_tiny_model

    build_tiny_model(tiny.out_dir, seed=int(tiny.seed), shape=tiny.get("shape", "default"))
    warm = tiny.get("warm_start")
    if warm and warm.get("out_dir"):
        warm_start(
            tiny.out_dir,
            warm.out_dir,
            list(warm.tasks),
            OmegaConf.to_container(config.env_service.bfcl, resolve=True),
            int(warm.steps),
            float(warm.lr),
            int(tiny.seed),
            OmegaConf.to_container(warm.get("decoys") or {}, resolve=True),
        )


def warm_start(
    base_dir: str | Path,
    out_dir: str | Path,
    tasks: list[str],
    env_params: dict,
    steps: int,
    lr: float,
    seed: int = 0,
    decoys: dict[str, list[str]] | None = None,
) -> Path:
    """Train ``base_dir``'s model ``steps`` full-batch AdamW steps on the tasks' ground-truth episodes, and on the
    decoy episodes of each task named in ``decoys`` (``{task: [old, new_1, ..., new_k]}``: one episode per ``new``,
    whose first call has ``old`` replaced by it); write to ``out_dir`` (returns at once when ``out_dir`` already
    holds this spec's result).

    Why decoys: trained to convergence on a task's right first call and k wrong ones alike, the model is sure of
    every token but one choice, which it gets right about 1 time in k + 1. GRPO then has a clear signal (groups
    that both pass and fail) and room to raise the reward, on a model that is not at a sharp, half-trained point
    where any update breaks it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, out_dir = Path(base_dir).resolve(), Path(out_dir).resolve()
    decoys = {task: list(texts) for task, texts in (decoys or {}).items()}
    unknown = sorted(set(decoys) - set(tasks))
    if unknown:
        raise ValueError(f"warm-start decoys name tasks that are not warm-start tasks: {unknown}")
    for task, texts in decoys.items():
        if len(texts) < 2 or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"warm-start decoys of {task} must be [old, new, ...] strings, got {texts!r}")
    spec = warm_start_spec(base_dir, tasks, env_params, steps, lr, seed, decoys)
    try:
        if json.loads((out_dir / SPEC_FILE).read_text()) == spec:
            return out_dir
    except (OSError, ValueError):
        pass
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model_type = model.config.model_type

    def task_examples(task: str) -> list[tuple[list[int], list[int]]]:
        """The task's ground-truth episode and its decoys: they share every token up to the first call's choice."""
        old, *wrong = decoys.get(task, [None])
        return [
            episode_tokens(task, env_params, tokenizer, model_type),
            *(episode_tokens(task, env_params, tokenizer, model_type, (old, new)) for new in wrong),
        ]

    torch.manual_seed(seed)
    fit_examples(model, [task_examples(task) for task in tasks], steps, lr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:  # written aside and swapped in, so a crash never leaves a directory that looks finished
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True))
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
