"""Do a recipe's first prompts fit ``data.max_prompt_length``? Rendered by the environment service's own code.

The agent loop refuses a first prompt longer than ``rollout.prompt_length`` (it never truncates tool schemas), so
preflight renders every first prompt a run will send — through the environment service in-process, with the
recipe's ``env_service.bfcl`` block and, when capability cues are on, a failure profile that selects the longest
cue lines — applies the chat template and counts tokens.

Tokenizer: the model's own when ``model.path`` is a local directory (exact count). Otherwise (a hub id, offline)
the Qwen2.5 tokenizer that ``seal.cpu.tiny_model`` builds offline stands in, and the count gets a safety margin: the
stand-in has Qwen2.5's exact vocabulary and a ChatML template, but another family (ToolACE-2 is Llama-3.1)
tokenizes differently (Llama-3 groups up to 3 digits where Qwen splits every digit, so the JSON tool docs
usually count fewer tokens there) and its chat template adds a header (Llama-3.1: a dated system preamble).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from env_service.vocabulary import mode_for_split

#: Safety margin on stand-in counts: relative (tokenizer differences) plus absolute (chat-template header).
STAND_IN_MARGIN = 0.05
TEMPLATE_ALLOWANCE = 64

STAND_IN = "<offline Qwen2.5 stand-in>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class LongestPrompt:
    """The longest first prompt of one episode mode: its token count and what the budget must hold."""

    task_id: str
    mode: str
    tokens: int  # counted with the tokenizer in use
    required: int  # tokens, plus the stand-in margin when the tokenizer is not the model's own
    exact: bool  # counted with the model's own tokenizer and chat template

    def describe(self) -> str:
        how = (
            ""
            if self.exact
            else (
                f" ({self.tokens} counted with the offline Qwen2.5 stand-in tokenizer, model.path is not a local "
                f"directory, + {STAND_IN_MARGIN:.0%} + {TEMPLATE_ALLOWANCE} tokens margin)"
            )
        )
        return f"{self.task_id} in {self.mode} mode needs {self.required} tokens{how}"


def required_tokens(tokens: int, exact: bool) -> int:
    return tokens if exact else math.ceil(tokens * (1 + STAND_IN_MARGIN)) + TEMPLATE_ALLOWANCE


def has_own_tokenizer(model_path: str) -> bool:
    return os.path.isdir(model_path) and any((Path(model_path) / name).exists() for name in TOKENIZER_FILES)


@functools.lru_cache(maxsize=4)
def budget_tokenizer(model_path: str):
    """``(tokenizer, exact)``; cached per process (the stand-in takes a few seconds to build)."""
    if model_path != STAND_IN and has_own_tokenizer(model_path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path), True
    from seal.cpu.tiny_model import build_tokenizer

    return build_tokenizer(), False


def worst_case_profile(env_params: dict) -> dict | None:
    """A failure profile under which capability cues pick their ``max_lines`` longest guidelines (None: cues off)."""
    from env_service.bfcl.config import EnvConfig
    from env_service.bfcl.interface import DEFAULT_GUIDELINES

    cues = EnvConfig.from_dict(env_params).capability_cues
    if not cues.enable:
        return None
    texts = {**DEFAULT_GUIDELINES, **(cues.guidelines or {})}
    texts = {tag: text for tag, text in texts.items() if text and text.strip()}
    longest = sorted(texts, key=lambda tag: (-len(texts[tag]), tag))[: cues.max_lines]
    count = max(int(cues.min_tag_count), 1) * 1000
    return {"tags": {tag: {"count": count, "reward_mean": 0.0} for tag in longest}}


def first_prompts(env_params: dict, episodes, profile: dict | None = None):
    """``(task_id, mode, messages)`` for each ``(task_id, mode)``, exactly as the service starts the episode."""
    from env_service.client import InProcessEnvClient

    client = InProcessEnvClient()
    if profile:
        client.set_profile(profile)
    for task_id, mode in episodes:
        created = client.create(task_id, mode, env_params)
        client.release(created["instance_id"])
        yield task_id, mode, created["messages"]


class TokenCounter:
    """Counts the tokens of chat-rendered prompts, fast.

    A fast tokenizer cuts its input at added tokens (``<|im_end|>``...) before it runs BPE on the pieces, so a
    prompt's count is the sum over its pieces; the long system piece (the tool docs) recurs across tasks and is
    tokenized once. The shortcut is checked against a direct count on the longest prompt (see ``longest``).
    """

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._pieces: dict[str, int] = {}

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def direct(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def pieces(self, text: str) -> int:
        if self._split is None:
            return self.direct(text)
        total = 0
        for index, piece in enumerate(self._split.split(text)):
            if index % 2:  # an added token
                total += 1
            elif piece:
                if piece not in self._pieces:
                    self._pieces[piece] = self.direct(piece)
                total += self._pieces[piece]
        return total


def longest(
    model_path: str, env_params: dict, episodes: list[tuple[str, str]], chat_template: str | None = None
) -> dict[str, LongestPrompt]:
    """The longest first prompt per mode among ``episodes`` (``(task_id, mode)`` pairs).

    ``chat_template``: the recipe's ``model.custom_chat_template`` (verl renders with it instead of the model's)."""
    tokenizer_source = model_path if has_own_tokenizer(model_path) else STAND_IN  # hub ids share the stand-in
    key = json.dumps(env_params, sort_keys=True, default=str)
    return dict(_longest(tokenizer_source, key, tuple(episodes), chat_template))


@functools.lru_cache(maxsize=16)
def _longest(tokenizer_source: str, env_params_json: str, episodes: tuple, chat_template: str | None) -> tuple:
    tokenizer, exact = budget_tokenizer(tokenizer_source)
    counter = TokenCounter(tokenizer, chat_template)
    env_params = json.loads(env_params_json)
    prompts = [
        (task_id, mode, counter.render(messages))
        for task_id, mode, messages in first_prompts(env_params, episodes, worst_case_profile(env_params))
    ]
    best = _longest_per_mode(prompts, counter.pieces)
    if any(counter.direct(text) != tokens for tokens, _, text in best.values()):
        best = _longest_per_mode(prompts, counter.direct)  # the piecewise shortcut does not hold here
    return tuple(
        (mode, LongestPrompt(task_id, mode, tokens, required_tokens(tokens, exact), exact))
        for mode, (tokens, task_id, _) in sorted(best.items())
    )


def _longest_per_mode(prompts, count) -> dict[str, tuple[int, str, str]]:
    best: dict[str, tuple[int, str, str]] = {}
    for task_id, mode, text in prompts:
        best[mode] = max(best.get(mode, (-1, "", "")), (count(text), task_id, text))
    return best


class DataFileError(ValueError):
    """A data file no run can use; the message names the file (and the row) and what is wrong."""


def task_rows(path: str, prompt_key: str = "prompt") -> list[dict]:
    """The ``extra_info`` of every row of a recipe's data file, each with a task id: what the agent loop reads
    (``extra_info.task_id``, ``extra_info.split``) and what verl's dataset reads (``prompt_key``) must be there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        missing = [column for column in ("extra_info", prompt_key) if column not in names]
        table = None if missing else pq.read_table(path, columns=["extra_info"])
    except (pa.ArrowException, OSError) as exc:
        raise DataFileError(f"{path!r} is not a readable parquet file ({_one_line(exc)})") from None
    if missing:
        raise DataFileError(
            f"{path!r} has no {' or '.join(missing)} column (it has {names}); a run's rows carry the prompt in "
            f"{prompt_key!r} and the task in extra_info.task_id, as scripts/make_split.py writes them"
        )
    if table.num_rows == 0:
        raise DataFileError(f"{path!r} has no rows")
    rows = table.column("extra_info").to_pylist()
    for row, extra in enumerate(rows):
        task_id = extra.get("task_id") if isinstance(extra, dict) else None
        if not isinstance(task_id, str) or not task_id:
            raise DataFileError(
                f"{path!r} row {row} (counting from 0): extra_info.task_id is {task_id!r}, expected a task id like 'multi_turn_base_0'"
            )
    return rows


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def run_episodes(data_files) -> list[tuple[str, str]]:
    """``(task_id, mode)`` for every row of the recipe's data files, with the mode the agent loop will use
    (train rows run in train mode, every other row in validate mode)."""
    episodes = []
    for path in data_files:
        for extra in task_rows(path):
            episodes.append((extra["task_id"], mode_for_split(extra.get("split"))))
    return list(dict.fromkeys(episodes))
