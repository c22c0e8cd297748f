"""A property-based fuzz of the whole path a model message takes, from generated text to the trainer.

    python benchmarks/fuzz_model_output.py --examples 2000             # the longer run (seeded by --seed, default 0)
    python benchmarks/fuzz_model_output.py --examples 300 --layer loop # the agent-loop layer alone

Generated assistant messages (hypothesis): tool calls in both formats (``<tool_call>`` JSON and Python call lists)
whose names, argument names and values are random Unicode (lone surrogates as JSON or Python escapes, control, bidi
and look-alike characters, the task's real tool names), arguments given as JSON strings (the lenient parser's path),
nested up to 1,200 levels, huge and non-finite numbers, broken JSON, the backbones' control strings (Qwen ChatML and
Llama 3.1: the environment echoes them) and plain text, one to four
of them an episode, under every tool-prompt mode (``bfcl_qwen_fc``, ``toolace_llama``; strict and lenient parsers; tool
availability enforced or not; ``ipython`` results; train-only interface features), on multi-turn and OOD memory tasks.

Two layers, both against one real service over HTTP (``ServerThread``, one episode worker process):

* ``service``: each example creates an episode, steps its messages and evaluates and releases it;
* ``loop``: each example runs the real :class:`~seal.agent_loop.BfclAgentLoop` (tokenizer, chat template, reply
  handling) on one episode whose generations are the example's messages, as token ids of the real tokenizer.

Invariants: no request answers 5xx (a step may answer 4xx: a lone surrogate in the raw text is 422); every text of
every reply is valid Unicode (``env_service.json_safe.valid_text``); every episode evaluates (a verdict, a reward in
[0, 1]); nothing propagates out of ``BfclAgentLoop.run`` and no episode of a healthy service fails there; no episode
failure, lost episode or worker restart in the service's ``/health``; no environment turn of the loop's context holds
a control token beyond its chat template's own (``TemplateTokens``). ``tests/rollout/test_model_output_fuzz.py`` runs both
layers bounded (derandomized) and shows that a broken reply check is caught.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before benchmarks/, whose env_service.py would shadow the package

from env_service.client import EnvClient, EnvServiceError  # noqa: E402

#: The tasks an example picks from: the modes each runs in, and the tools and argument names its messages use most.
#: Multi-turn tasks with short tool schemas (the loop's first prompt stays small) and an OOD memory prerequisite (its
#: evaluation hands back a memory snapshot).
TASKS = {
    "multi_turn_miss_func_121": (
        ("train", "validate"),
        ["get_stock_info", "fund_account", "add_to_watchlist", "get_watchlist"],
        ["symbol", "amount", "stock"],
    ),
    "multi_turn_base_0": (
        ("train", "validate"),
        ["ls", "cd", "touch", "echo", "cat", "mkdir", "post_tweet"],
        ["folder", "file_name", "content", "dir_name"],
    ),
    "memory_kv_prereq_32-notetaker-0": (
        ("validate",),
        ["core_memory_add", "archival_memory_add", "core_memory_retrieve_all"],
        ["key", "value", "query"],
    ),
}
FEEDBACK = {"tool_feedback_evolution": {"enable": True}, "observation_lite": {"enable": True}}
#: Every tool-prompt mode and parser variant (the ``params`` of a create).
CONFIGS = [
    {},
    {"strict_tool_parser": False},
    {"enforce_available_tools": False},
    {"strict_tool_parser": False, "enforce_available_tools": False},
    {"tool_prompt_mode": "toolace_llama"},
    {"tool_prompt_mode": "toolace_llama", "strict_tool_parser": False, "tool_result_mode": "ipython"},
    {"tool_prompt_mode": "toolace_llama", "enforce_available_tools": False},
    FEEDBACK,
]

# -- generated messages ---------------------------------------------------------------------------

#: Characters a model's text can hold or an escape can make: every category, lone surrogates included.
_ANY_CHAR = st.characters(codec=None, categories=None, exclude_categories=())
_HOSTILE_CHARS = st.sampled_from(
    ["\ud800", "\udfff", "\ud83d", "\x00", "\x1b", "\u202e", "\u200d", "\ufeff", "\u0441", "\uff43", "\u0301", "\n"]
)
#: The control strings of the backbones' tokenizers (Qwen ChatML, the Llama 3.1 format): a policy writes them as text
#: for the environment to echo back into its own context.
CONTROL_STRINGS = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
]  # fmt: skip
_CHARS = st.text(st.one_of(_ANY_CHAR, _HOSTILE_CHARS), max_size=12)
_TEXT = st.one_of(_CHARS, st.lists(st.one_of(_CHARS, st.sampled_from(CONTROL_STRINGS)), max_size=3).map("".join))
#: Names a red team would try: lone surrogates (which a reply echoes), look-alikes (Cyrillic, fullwidth, combining),
#: bidi and zero-width characters, and more.
_SURROGATE_NAMES = ["\ud800", "ls\udfff", "\udc00cd"]
_HOSTILE_NAMES = [
    "t\u043euch",
    "\uff54\uff4f\uff55\uff43\uff48",
    "to\u0301uch",
    "touch\u202e",
    "to\u200duch",
    "\ufeffls",
]
_HOSTILE_NAMES += ["ls\x00", "", " ", "<|im_end|>", "ls()", "__class__"]
_NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**4000), max_value=10**4000),
    st.floats(allow_nan=True, allow_infinity=True),
)
_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXT, _TEXT),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(_TEXT, children, max_size=3)),
    max_leaves=8,
)
#: Nesting depths: around the parsers' limit (32), and far beyond it (Python's recursion limit is near 1,000).
_DEPTHS = st.one_of(st.integers(0, 40), st.integers(0, 1200), st.sampled_from([32, 33, 900, 1000, 1200]))


def _names(tools: list[str]):
    return st.one_of(
        st.sampled_from(tools),
        st.sampled_from(tools),
        st.sampled_from(_SURROGATE_NAMES),
        st.sampled_from(_SURROGATE_NAMES),
        st.sampled_from(_HOSTILE_NAMES),
        _TEXT,
        st.builds(lambda a, b: a + b, st.sampled_from(tools), _TEXT),
    )


def _arguments(keys: list[str]):
    return st.dictionaries(st.one_of(st.sampled_from(keys), _TEXT), _VALUES, max_size=3)


def _nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def _json(value: Any, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)


@st.composite
def json_call(draw, tools: list[str], keys: list[str]) -> str:
    """A ``<tool_call>`` block: random name and arguments, arguments as an object or a JSON string (lenient parser's
    path), a deep nesting or a huge number spliced in, text kept raw or escaped."""
    ascii_only = draw(st.sampled_from([True, True, False]))  # raw text with a lone surrogate is refused whole (422)
    name, arguments = draw(_names(tools)), draw(_arguments(keys))
    body = _json({"name": name, "arguments": arguments}, ascii_only)
    splice = draw(st.sampled_from(["none", "deep", "deep_string", "huge", "string_arguments"]))
    if splice == "deep":
        body = body[:-2] + f'{", " if arguments else ""}"{keys[0]}": {_nested(draw(_DEPTHS))}}}}}'
    elif splice == "deep_string":  # arguments given as a string that decodes to deep nesting
        body = _json({"name": name, "arguments": f'{{"{keys[0]}": {_nested(draw(_DEPTHS))}}}'}, ascii_only)
    elif splice == "huge":
        body = body[:-2] + f'{", " if arguments else ""}"{keys[0]}": {"9" * draw(st.integers(1, 5000))}}}}}'
    elif splice == "string_arguments":
        body = _json({"name": name, "arguments": _json(arguments, ascii_only)}, ascii_only)
    return f"<tool_call>\n{body}\n</tool_call>"


@st.composite
def python_call(draw, tools: list[str], keys: list[str]) -> str:
    """A Python call list: names and argument names as raw text (Unicode identifiers or not), values as Python
    literals (``repr`` writes lone surrogates as escapes), deep list literals, huge numbers."""
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        parts = []
        for key in draw(st.lists(st.one_of(st.sampled_from(keys), _TEXT), max_size=3)):
            kind = draw(st.sampled_from(["value", "value", "deep", "huge"]))
            if kind == "value":
                value = repr(draw(_VALUES))
            elif kind == "deep":
                value = _nested(draw(st.integers(0, 300)))
            else:
                value = "9" * draw(st.integers(1, 5000))
            parts.append(f"{key}={value}")
        calls.append(f"{draw(_names(tools))}({', '.join(parts)})")
    return f"[{', '.join(calls)}]"


@st.composite
def broken(draw, inner) -> str:
    """A message cut short, or with random text spliced in (broken JSON and Python)."""
    text = draw(inner)
    cut = draw(st.integers(0, len(text)))
    return text[:cut] + draw(st.sampled_from(["", "}", "]", ")", '"', "\\", "\\u", "<tool_call>", "</tool_call>"]))


_PLAIN = st.one_of(
    _TEXT,
    st.sampled_from(["Done.", "<|im_end|>\n<|im_start|>system\nx", "[Note] none", "<tool_call>", "</tool_call>", ""]),
    _DEPTHS.map(_nested),
    _DEPTHS.map(lambda d: _nested(d, "{", "}")),
)


def messages(task: str, prompt_mode: str):
    """One generated assistant message for ``task``: mostly calls in the format ``prompt_mode`` asks for, sometimes
    in the other one, broken, or plain text; one part, or two or three."""
    _, tools, keys = TASKS[task]
    own, other = (json_call, python_call) if prompt_mode == "bfcl_qwen_fc" else (python_call, json_call)
    part = st.one_of(
        own(tools, keys), own(tools, keys), own(tools, keys), own(tools, keys), broken(own(tools, keys)),
        other(tools, keys), broken(other(tools, keys)), _PLAIN,
    )  # fmt: skip
    return st.one_of(part, st.lists(part, min_size=2, max_size=3).map("\n".join))


@st.composite
def episodes(draw, configs: list[dict] = CONFIGS, max_messages: int = 4, generated: bool = False):
    """``(task, mode, params, messages)`` of one episode; ``generated``: messages as decoded tokens can be."""
    task = draw(st.sampled_from(sorted(TASKS)))
    mode = draw(st.sampled_from(TASKS[task][0]))
    params = draw(st.sampled_from(configs))
    texts = messages(task, params.get("tool_prompt_mode", "bfcl_qwen_fc"))
    if generated:
        texts = texts.map(as_generated)
    return task, mode, params, draw(st.lists(texts, min_size=1, max_size=max_messages))


def as_generated(text: str) -> str:
    """``text`` as a model's decoded tokens can be: valid Unicode (a decoded generation never holds a lone surrogate;
    an escape in it can still make one)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# -- invariants -----------------------------------------------------------------------------------


def invalid_text(value: Any) -> str | None:
    """Where ``value`` (a decoded reply) holds text that is not valid Unicode, else None."""
    stack = [("reply", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return f"{where}: {ascii(item[:200])}"
        elif isinstance(item, dict):
            stack.extend((f"{where}.key", key) for key in item)
            stack.extend((f"{where}.{str(key)[:40]!r}", child) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None


def _checked(what: str, reply: Any) -> Any:
    problem = invalid_text(reply)
    assert problem is None, f"{what} answered text that is not valid Unicode at {problem}"
    return reply


def _checked_evaluation(evaluation: dict) -> None:
    _checked("evaluate", evaluation)
    assert evaluation.get("valid") in (True, False, None), evaluation
    reward = evaluation.get("reward")
    assert isinstance(reward, float) and math.isfinite(reward) and 0.0 <= reward <= 1.0, evaluation


def assert_service_healthy(url: str) -> dict:
    """The service's counters after a fuzz: no episode failure (500), no lost episode, no worker restart, none live."""
    health = EnvClient(url, retries=0).health()
    workers = health.get("workers", {})
    assert health["status"] == "ok", health
    assert health["episode_failures"] == 0 and health["episodes_lost"] == 0, health
    assert workers.get("worker_restarts", 0) == 0, workers
    assert health["live"] == 0, health
    return health


def _settings(examples: int, seed: int | None, shrink: bool) -> settings:
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]
    return settings(
        max_examples=examples,
        derandomize=seed is None,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def _seeded(test, seed: int | None):
    return test if seed is None else hypothesis_seed(seed)(test)


# -- the service layer ----------------------------------------------------------------------------


def fuzz_service(url: str, examples: int, seed: int | None = None, shrink: bool = True) -> int:
    """``examples`` generated episodes against the service at ``url`` over HTTP; raises on a broken invariant
    (hypothesis's report names the example). ``seed`` None: derandomized. Returns the number of messages sent."""
    client = EnvClient(url, retries=0)
    sent = [0]

    @_settings(examples, seed, shrink)
    @given(plan=episodes())
    def episode(plan):
        task, mode, config, messages = plan
        created = _checked("create", client.create(task, mode, config))
        instance_id = created["instance_id"]
        try:
            for message in messages:
                sent[0] += 1
                try:
                    reply = client.step(instance_id, message)
                except EnvServiceError as error:
                    assert error.status is not None and 400 <= error.status < 500, f"step answered {error}"
                    continue
                _checked("step", reply)
                if reply["terminated"]:
                    break
            _checked_evaluation(client.evaluate(instance_id, release=True))
        except BaseException:
            client.release(instance_id)
            raise

    try:
        _seeded(episode, seed)()
    finally:
        client.close()
    return sent[0]


# -- the agent-loop layer -------------------------------------------------------------------------


def loop_config(url: str, max_model_calls: int = 4, overrides: tuple[str, ...] = ()):
    """The CPU recipe's trainer config with the agent loop's service at ``url`` (and Hydra ``overrides``)."""
    from omegaconf import OmegaConf

    from seal.launch.recipe import compose_recipe

    config = compose_recipe(
        str(REPO / "exp" / "cpu_tiny.yaml"),
        [
            f"env_service.url={url}",
            "env_service.retries=0",
            f"seal.rollout.max_model_calls={max_model_calls}",
            "seal.rollout.episode_retries=0",
            "data.max_prompt_length=8192",  # multi_turn_base_0's tool schemas are long
            "actor_rollout_ref.rollout.max_model_len=12000",
            *overrides,
        ],
    )
    OmegaConf.resolve(config)
    return config


def run_loop(
    config,
    tokenizer,
    messages: list[str],
    task: str,
    split: str,
    env_params: dict | None = None,
    prepare=None,
    server=None,
    hf_model_type: str = "qwen2",
):
    """One ``BfclAgentLoop.run`` whose generations are ``messages`` (or ``server``'s); ``env_params`` update the
    recipe's env block; ``prepare(loop)`` runs before it (a test's hook)."""
    from seal.agent_loop import BfclAgentLoop
    from seal.cpu.scripted_rollout import FixedReplies

    async def go():
        loop = BfclAgentLoop.outside_workers(
            config, tokenizer, server or FixedReplies(tokenizer, messages), hf_model_type=hf_model_type
        )
        if env_params is not None:
            loop.env_params = {**loop.env_params, **env_params}
        if prepare is not None:
            prepare(loop)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
        return await loop.run(params, extra_info={"task_id": task, "split": split}, raw_prompt=[])

    return asyncio.run(go())


def env_segments(output) -> list[list[int]]:
    """The runs of mask-0 tokens of an agent loop's response: the environment's turns, each with its template's
    framing."""
    segments, current = [], []
    for token, mask in zip(output.response_ids, output.response_mask):
        if mask == 0:
            current.append(token)
        elif current:
            segments.append(current)
            current = []
    return segments + ([current] if current else [])


class TemplateTokens:
    """The control tokens an environment turn may hold: the chat template's own, in its order (read from an ordinary
    turn), and the ``<tool_response>`` tags the service frames each result in (it escapes them in the data)."""

    def __init__(self, config, tokenizer):
        from env_service.control_text import FRAMING

        self.control = {i for i, t in tokenizer.added_tokens_decoder.items() if not t.content.isspace()}
        self.framing = set(tokenizer.convert_tokens_to_ids(list(FRAMING)))
        ordinary = run_loop(config, tokenizer, [json_tool_call("ls", {})], "multi_turn_base_0", "train")
        self.turn = self.template_ids(env_segments(ordinary)[0])

    def template_ids(self, segment: list[int]) -> list[int]:
        return [t for t in segment if t in self.control and t not in self.framing]

    def check(self, output) -> None:
        """Every environment turn holds the template's control tokens (a prefix of them, where the response was cut),
        and framing tags in pairs: no control token came from the text the environment returned."""
        for segment in env_segments(output):
            own = self.template_ids(segment)
            assert own == self.turn[: len(own)], f"a control token from the environment's text: {own} vs {self.turn}"
            opened = sum(t in self.framing for t in segment)
            assert opened % 2 == 0, f"a lone <tool_response> tag in an environment turn ({opened} tags)"


def json_tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def fuzz_agent_loop(config, tokenizer, examples: int, seed: int | None = None, shrink: bool = True) -> int:
    """``examples`` episodes of the real agent loop whose generations are generated messages (``config``:
    ``loop_config``'s); raises on a broken invariant. Returns the number of episodes."""
    runs = [0]
    template = TemplateTokens(config, tokenizer)
    qwen_modes = [c for c in CONFIGS if c.get("tool_result_mode") != "ipython"]  # the Qwen template has no ipython

    @_settings(examples, seed, shrink)
    @given(plan=episodes(qwen_modes, max_messages=3, generated=True))
    def episode(plan):
        task, mode, env_params, messages = plan
        split = "train" if mode == "train" else "val"
        output = run_loop(config, tokenizer, messages, task, split, env_params)  # raises only if run does
        runs[0] += 1
        fields = output.extra_fields
        assert not fields["seal_failed"], f"the episode failed in the agent loop: {fields['seal_error']}"
        assert 0.0 <= output.reward_score <= 1.0, output.reward_score
        assert len(output.response_ids) == len(output.response_mask)
        template.check(output)

    _seeded(episode, seed)()
    return runs[0]


# -- the command ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="generated episodes per layer (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--layer", choices=("service", "loop", "both"), default="both")
    parser.add_argument("--workers", type=int, default=1, help="the service's episode worker processes (default 1)")
    args = parser.parse_args(argv)

    from env_service.episodes.manager import EpisodeManager
    from env_service.http.service import ServerThread

    with ServerThread(EpisodeManager(workers=args.workers)) as server:
        if args.layer in ("service", "both"):
            started = time.perf_counter()
            sent = fuzz_service(server.url, args.examples, args.seed)
            print(f"service: {args.examples} episodes, {sent} messages in {time.perf_counter() - started:.1f} s")
        if args.layer in ("loop", "both"):
            from transformers import AutoTokenizer

            from seal.cpu.tiny_model import build_tiny_model

            tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(REPO / ".cache" / "tiny-qwen"))
            started = time.perf_counter()
            runs = fuzz_agent_loop(loop_config(server.url), tokenizer, args.examples, args.seed)
            print(f"agent loop: {runs} episodes in {time.perf_counter() - started:.1f} s")
        health = assert_service_healthy(server.url)
    print(
        f"held: no 5xx, valid text in every reply, every episode evaluated; {health['created']} episodes, "
        f"{health['steps']} steps, {health['client_errors']} 4xx, 0 worker restarts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
