"""Reading tool calls out of the raw assistant text.

Two formats, one result type (:class:`ParsedMessage`):

* ``<tool_call>{json}</tool_call>`` blocks (:func:`parse_tool_calls`, prompt mode ``bfcl_qwen_fc``) —
  the released environment's ``xml_json`` parser, every rule and error text as released.
* a Python call list ``[f(a=1), g(b="x")]`` (:func:`parse_python_calls`, prompt mode ``toolace_llama``) —
  the output format of bfcl's default prompting system prompt. Read with :mod:`ast`; argument values
  must be literals (``ast.literal_eval`` on the node, which never evaluates code).

Both functions never raise, whatever the input (non-str, lone surrogates, huge or deeply nested text):
anything unexpected becomes an error string. Limits (far above anything a 4096-token generation can
produce, and only there to bound work on hostile input arriving through the HTTP API):

* :data:`MAX_TEXT_CHARS` — longer messages are not parsed (strict mode: one error).
* :data:`MAX_CALLS_PER_MESSAGE` — more calls than this in one message is an error.
* :data:`MAX_ARGUMENT_DEPTH` — deeper argument nesting is an error (keeps later ``repr``/``deepcopy`` of
  the arguments in the executor and verifier far from Python's recursion limit).
* a name, argument name or string value that is not valid Unicode (a lone surrogate: only an escape such as
  ``"\\ud800"`` makes one, since the message itself is valid text) is an error: the call would be kept, run and
  replayed with text that no snapshot, verdict or tokenizer can take.

:func:`call_problem` holds these last two limits for every prompt mode and parser: both parsers apply it to the calls
they read, and the episode applies it again to arguments it decodes itself (the lenient parser passes string
arguments on as given), so no call is kept or run beyond them whichever mode read it.
* names longer than :data:`MAX_NAME_CHARS_SHOWN` are shortened inside error messages.

The ``<tool_call>`` matcher is a linear-time equivalent of the released parser's regular expression
:data:`TOOL_CALL_PATTERN` (whose backtracking is quadratic on unterminated, repeated blocks — a real
degenerate-policy output), and the Markdown-fence reader one of :data:`FENCE_PATTERN` (cubic on runs of blanks);
``tests/env/test_parser.py`` checks both equivalences on random inputs, ``tests/env/test_parser_cost.py`` that reading any
message costs linear time in its length. Every other pattern here is linear: keep it so (no two quantifiers that can
take the same characters side by side).
"""

from __future__ import annotations

import ast
import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any

from env_service.bfcl.calls import ToolCall

#: The released parser's pattern (used with ``re.DOTALL``); the reference for the linear matcher below.
TOOL_CALL_PATTERN = r"<tool_call>\s*\n?({.*?})\s*\n?\</tool_call>"

MAX_TEXT_CHARS = 1_000_000
MAX_CALLS_PER_MESSAGE = 256
MAX_ARGUMENT_DEPTH = 32
MAX_NAME_CHARS_SHOWN = 200

_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"

# The released parser's error texts (verbatim).
ERR_NO_VALID_BLOCK = "Found tool_call tag text, but no valid <tool_call>{...}</tool_call> block."
ERR_MISSING_KEYS = "Tool call JSON must contain both 'name' and 'arguments'."


@dataclass
class ParsedMessage:
    """What the assistant said: free text, the calls it made, and why some could not be read.

    ``errors`` is filled in strict mode only; in lenient mode unreadable calls are dropped silently.
    ``call_ids`` are the released environment's ids ``<name>_<k>`` (k counts accepted calls from 1).
    """

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def call_ids(self) -> list[str]:
        return [f"{call.name}_{k}" for k, call in enumerate(self.calls, start=1)]

    @property
    def error_text(self) -> str:
        """Errors joined as in the environment's reply."""
        return "; ".join(self.errors)


# ------------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------------


def _as_text(text: Any) -> str:
    if isinstance(text, str):
        return text
    if text is None:
        return ""
    try:
        return str(text)
    except Exception:  # a hostile __str__; nothing sensible to parse
        return ""


def shown_name(name: Any) -> str:
    """``name`` as it appears inside an error message (``str()`` like the released environment's f-strings)."""
    try:
        text = str(name)
    except Exception:
        text = "<unprintable>"
    if len(text) > MAX_NAME_CHARS_SHOWN:
        text = text[:MAX_NAME_CHARS_SHOWN] + "..."
    return text


def _lone_surrogate(text: str) -> str | None:
    """The first lone surrogate of ``text`` as its escape, or None (``isascii`` is O(1): most text costs nothing)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return ascii(text[error.start])
    return None


_TOO_DEEP = "too deep"


def _broken_limit(name: Any, arguments: Any) -> str | None:
    """:data:`_TOO_DEEP` when containers nest deeper than :data:`MAX_ARGUMENT_DEPTH` (the arguments are level 1), else
    the first lone surrogate (as its escape) in the name, argument names or string values, else None. One iterative
    walk over the containers (safe at any depth; scalars are looked at where they sit, never stacked)."""
    surrogate = _lone_surrogate(name) if isinstance(name, str) else None
    if isinstance(arguments, str):  # the lenient parser's string arguments, before the episode decodes them
        return surrogate or _lone_surrogate(arguments)
    stack = [(arguments, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
            keys = item.keys()
        elif isinstance(item, (list, tuple)):
            children, keys = item, ()
        else:
            continue
        if depth > MAX_ARGUMENT_DEPTH:
            return _TOO_DEEP
        for child in (*keys, *children) if surrogate is None else children:
            if isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
            elif surrogate is None and isinstance(child, str):
                surrogate = _lone_surrogate(child)
    return surrogate


def call_problem(name: Any, arguments: Any) -> str | None:
    """Why a call breaks a limit that holds whichever prompt mode read it (arguments nested deeper than
    :data:`MAX_ARGUMENT_DEPTH`, or text that is not valid Unicode); None when it keeps them."""
    broken = _broken_limit(name, arguments)
    if broken == _TOO_DEEP:
        return _too_deep_error(name)
    if broken is not None:
        return (
            f"Tool '{shown_name(name)}' call has text that is not valid Unicode (a lone surrogate {broken}); "
            f"write characters, not surrogate escapes."
        )
    return None


def _too_long_error(n: int) -> str:
    return f"Assistant message too long ({n} characters > {MAX_TEXT_CHARS}); it was not parsed."


def _too_many_calls_error(n: int) -> str:
    return f"Too many tool calls in one message ({n} > {MAX_CALLS_PER_MESSAGE})."


def _too_deep_error(name: Any) -> str:
    return f"Tool '{shown_name(name)}' arguments are nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)."


# ------------------------------------------------------------------------------------------------
# <tool_call>{json}</tool_call>
# ------------------------------------------------------------------------------------------------


def _skip_space(text: str, i: int) -> int:
    """First index >= i that is not whitespace (``\\s`` in a str regex == ``str.isspace``)."""
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def _closers(text: str) -> list[tuple[int, int]]:
    """Every way a block can end: ``(e, end)`` with ``text[e] == "}"``, then only whitespace, then
    ``</tool_call>`` ending at ``end``. Sorted by ``e``; linear overall (the whitespace runs scanned
    back from distinct closing tags are disjoint)."""
    out = []
    q = text.find(_CLOSE_TAG)
    while q != -1:
        e = q - 1
        while e >= 0 and text[e].isspace():
            e -= 1
        if e >= 0 and text[e] == "}":
            out.append((e, q + len(_CLOSE_TAG)))
        q = text.find(_CLOSE_TAG, q + 1)
    return out


def find_tool_call_blocks(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, json_text)`` for each match of :data:`TOOL_CALL_PATTERN` (DOTALL), as ``re.finditer``
    would report them, in linear time.

    A match starts at an opening tag followed (after optional whitespace) by ``{`` at index b; its
    ``{.*?}`` group ends at the first ``}`` after b that is followed by optional whitespace and a
    closing tag. Without such a ``}`` the regex fails at this opening tag and moves on to the next.
    """
    closers = _closers(text)
    closer_positions = [e for e, _ in closers]
    blocks = []
    pos = 0
    while True:
        start = text.find(_OPEN_TAG, pos)
        if start == -1:
            return blocks
        brace = _skip_space(text, start + len(_OPEN_TAG))
        if brace < len(text) and text[brace] == "{":
            k = bisect.bisect_right(closer_positions, brace)
            if k < len(closers):
                e, end = closers[k]
                blocks.append((start, end, text[brace : e + 1]))
                pos = end
                continue
        pos = start + 1


def _remove_blocks(text: str, blocks: list[tuple[int, int, str]]) -> str:
    """The released parser's content cleaning: drop the blocks, strip, collapse blank-line runs, strip."""
    pieces, last = [], 0
    for start, end, _ in blocks:
        pieces.append(text[last:start])
        last = end
    pieces.append(text[last:])
    cleaned = "".join(pieces).strip()
    return re.sub(r"\n\s*\n", "\n\n", cleaned).strip()


def _read_block(json_text: str, strict: bool) -> tuple[ToolCall | None, str | None]:
    """One block -> (call, None), (None, error) or (None, None) for a silently skipped non-object."""
    try:
        data = json.loads(json_text.strip())
    except Exception as exc:  # JSONDecodeError, RecursionError on deep nesting, MemoryError
        return None, f"Invalid tool call JSON: {exc}"
    if not isinstance(data, dict):
        return None, None
    if "name" not in data or "arguments" not in data:
        return None, ERR_MISSING_KEYS
    name, arguments = data["name"], data["arguments"]
    if strict:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except Exception:
                return None, f"Tool '{shown_name(name)}' has non-JSON string arguments."
        if not isinstance(arguments, dict):
            return None, f"Tool '{shown_name(name)}' arguments must be a JSON object."
    problem = call_problem(name, arguments)
    if problem:
        return None, problem
    return ToolCall(name=name, arguments=arguments), None


def parse_tool_calls(text: Any, strict: bool = True) -> ParsedMessage:
    """The ``<tool_call>{json}</tool_call>`` blocks of ``text``.

    Rules (the released ``xml_json`` parser): text outside blocks is kept as ``content``; no block at all
    while the text mentions ``<tool_call`` / ``</tool_call>`` is an error (strict); per block, invalid
    JSON is an error, a non-object JSON value is skipped silently, missing ``name``/``arguments`` is an
    error, and in strict mode string ``arguments`` are JSON-decoded and must end up an object. In lenient
    mode errors are not reported and ``arguments`` are passed on as given. Never raises.
    """
    try:
        return _parse_tool_calls(_as_text(text), strict)
    except Exception as exc:  # defensive: nothing above should raise, but a reply must never crash a step
        errors = [f"Invalid tool call JSON: {type(exc).__name__}"] if strict else []
        return ParsedMessage(content="", errors=errors)


def _parse_tool_calls(text: str, strict: bool) -> ParsedMessage:
    if len(text) > MAX_TEXT_CHARS:
        return ParsedMessage(content=text.strip(), errors=[_too_long_error(len(text))] if strict else [])
    blocks = find_tool_call_blocks(text)
    if not blocks:
        has_tag = "<tool_call" in text or _CLOSE_TAG in text
        return ParsedMessage(content=text.strip(), errors=[ERR_NO_VALID_BLOCK] if strict and has_tag else [])
    calls, errors = [], []
    for _, _, json_text in blocks:
        call, error = _read_block(json_text, strict)
        if error:
            errors.append(error)
        elif call is not None:
            calls.append(call)
    if len(calls) > MAX_CALLS_PER_MESSAGE:
        errors.append(_too_many_calls_error(len(calls)))
        calls = calls[:MAX_CALLS_PER_MESSAGE] if not strict else calls
    return ParsedMessage(content=_remove_blocks(text, blocks), calls=calls, errors=errors if strict else [])


# ------------------------------------------------------------------------------------------------
# [func(a=1), g(b="x")]  (toolace_llama)
# ------------------------------------------------------------------------------------------------
# Design (ours; bfcl's own prompting decoder is the model for it). After stripping a Markdown code fence,
# the whole reply is a call attempt if it is ``[...]`` or a bare ``name(...)`` (wrapped in brackets, as
# bfcl's decoder does); otherwise it is plain text and the turn ends. A ``[...]`` that does not parse
# and shows no ``[name(`` is prose (e.g. "[Note] ..."), not an error; a list without any call ("[]",
# "[1, 2]") is a reply without calls. Unlike bfcl's decoder, positional arguments are an error rather
# than silently dropped (the parser has no schema to name them), and argument values must be JSON-like
# literals (tuples become lists). In strict mode, ``<tool_call>`` tags or a ``[name(`` buried in prose
# are errors (the analogue of the "Found tool_call tag text" rule).

# A function name as a call attempt shows it: letters, digits, "_" and "." (Unicode letters too: Python's parser reads
# ``ｃｄ`` as ``cd``, as bfcl's decoder does), and invisible format characters (zero-width, bidi controls), which make
# the name unreadable to Python but must not make a call attempt look like prose that ends the turn.
_INVISIBLE = "\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff"
_NAME = rf"(?:[^\W\d]|[{_INVISIBLE}])(?:[\w.]|[{_INVISIBLE}])*"
_CALL_START = re.compile(rf"{_NAME}\(")
_EMBEDDED_CALL_LIST = re.compile(rf"\[\s*{_NAME}\s*\(")
#: The fence a reply may be wrapped in, as first written (used with ``re.match``): the reference for
#: :func:`_strip_fence`, which reads the same group in linear time. The pattern itself is cubic on a run of blanks
#: after an opening fence (its three blank runs share the same characters: a 1 KiB reply of blanks held a worker for
#: about 2 s, 64 KiB past the message budget).
FENCE_PATTERN = r"^```[\w-]*[ \t]*\n?(.*?)\n?[ \t]*```$"
# The opening fence alone: each quantifier's greedy first try is the match (what follows them is optional), so it
# never backtracks.
_FENCE_OPEN = re.compile(r"```[\w-]*[ \t]*\n?")

ERR_PY_EMBEDDED = (
    "Found function-call syntax, but the reply is not exactly one list [func_name(arg=value), ...]; "
    "reply with only that list, or with plain text."
)
ERR_PY_XML_TAGS = (
    "This prompt format expects a Python function-call list like [func_name(arg=value)], not <tool_call> tags."
)


def _strip_fence(text: str) -> str:
    """The reply inside a Markdown code fence (``FENCE_PATTERN``'s group, stripped), else ``text`` as it is."""
    inside = _fenced(text)
    return text if inside is None else inside.strip()


def _fenced(text: str) -> str | None:
    """``FENCE_PATTERN``'s group 1 on ``text`` (DOTALL, ``re.match``), or None where it does not match; linear.

    The closing fence must end the text (``$``: or just before a final newline). The group starts where the greedy
    opening (info string, blanks, a newline) ends, or at the closing fence when the opening reaches past it (the
    regex backtracks the opening one character at a time); being lazy, it ends at the first place from which only an
    optional newline and blanks lead to the closing fence."""
    end = len(text) - 1 if text.endswith("\n") else len(text)
    close = end - 3
    if not text.startswith("```") or close < 3 or text[close:end] != "```":
        return None
    start = min(_FENCE_OPEN.match(text).end(), close)
    blanks = close
    while blanks > start and text[blanks - 1] in " \t":
        blanks -= 1
    if blanks > start and text[blanks - 1] == "\n":
        blanks -= 1
    return text[start:blanks]


def _dotted_name(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


class _NotJsonLike(Exception):
    pass


class _TooDeep(_NotJsonLike):
    pass


def _json_like(value: Any, depth: int) -> Any:
    """``value`` (at level ``depth`` of the arguments, which are level 1) with tuples turned into lists; raises
    _NotJsonLike for bytes, sets, complex, Ellipsis, non-string dict keys, _TooDeep for nesting deeper than
    :data:`MAX_ARGUMENT_DEPTH` (the executor accepts JSON values only, so the Python call syntax gets the same value
    space, and the same depth limit, as the JSON one)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if depth > MAX_ARGUMENT_DEPTH:
        raise _TooDeep
    if isinstance(value, (list, tuple)):
        return [_json_like(item, depth + 1) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_like(item, depth + 1) for key, item in value.items()}
    raise _NotJsonLike


def _read_python_call(node: ast.AST) -> tuple[ToolCall | None, str | None]:
    if not isinstance(node, ast.Call):
        return None, "The function-call list contains an item that is not a function call."
    name = _dotted_name(node.func)
    if name is None:
        return None, "A function call has an invalid function name."
    if node.args:
        return None, (f"Tool '{shown_name(name)}' uses positional arguments; pass every argument as name=value.")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None, f"Tool '{shown_name(name)}' uses **kwargs, which is not supported."
        if keyword.arg in arguments:  # Python rejects this at compile time, ast.parse does not
            return None, f"Tool '{shown_name(name)}' repeats argument '{keyword.arg}'."
        try:
            value = _json_like(ast.literal_eval(keyword.value), depth=2)
        except _TooDeep:
            return None, _too_deep_error(name)
        except _NotJsonLike:
            return None, (f"Tool '{shown_name(name)}' argument '{keyword.arg}' is not a JSON-like literal value.")
        except Exception:  # ValueError for names/expressions; RecursionError, MemoryError
            return None, f"Tool '{shown_name(name)}' argument '{keyword.arg}' is not a literal value."
        arguments[keyword.arg] = value
    problem = call_problem(name, arguments)
    if problem:
        return None, problem
    return ToolCall(name=name, arguments=arguments), None


def parse_python_calls(text: Any, strict: bool = True) -> ParsedMessage:
    """Prompt mode ``toolace_llama``: the reply's Python call list (see the design note above).

    Never raises; never evaluates anything (``ast.parse`` + ``ast.literal_eval`` only).
    """
    try:
        return _parse_python_calls(_as_text(text), strict)
    except Exception as exc:  # defensive, as in parse_tool_calls
        errors = [f"Invalid function-call syntax: {type(exc).__name__}"] if strict else []
        return ParsedMessage(content="", errors=errors)


def _parse_python_calls(text: str, strict: bool) -> ParsedMessage:
    stripped = text.strip()
    if len(text) > MAX_TEXT_CHARS:
        return ParsedMessage(content=stripped, errors=[_too_long_error(len(text))] if strict else [])
    candidate = _strip_fence(stripped)
    looks_like_list = candidate.startswith("[") and candidate.endswith("]")
    looks_like_call = _CALL_START.match(candidate) is not None and candidate.endswith(")")
    if not (looks_like_list or looks_like_call):
        return _plain_python_reply(text, stripped, strict)
    if looks_like_call:
        candidate = f"[{candidate}]"  # bfcl's decoder wraps a bare call the same way
    try:
        body = ast.parse(candidate, mode="eval").body
    except Exception as exc:  # SyntaxError; ValueError (NUL bytes), RecursionError, MemoryError
        if not (looks_like_call or _EMBEDDED_CALL_LIST.search(candidate)):
            return _plain_python_reply(text, stripped, strict)  # e.g. "[Note] ..." is prose, not a call list
        detail = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        return _python_failure(stripped, f"Invalid function-call syntax: {detail}", strict)
    elements = body.elts if isinstance(body, (ast.List, ast.Tuple)) else []
    if not any(isinstance(node, ast.Call) for node in elements):
        return _plain_python_reply(text, stripped, strict)  # "[]" or a literal list: no calls, turn ends
    calls, errors = [], []
    for node in elements:
        call, error = _read_python_call(node)
        if error:
            errors.append(error)
        else:
            calls.append(call)
    if len(calls) > MAX_CALLS_PER_MESSAGE:
        errors.append(_too_many_calls_error(len(calls)))
        calls = calls[:MAX_CALLS_PER_MESSAGE] if not strict else calls
    return ParsedMessage(content="", calls=calls, errors=errors if strict else [])


def _plain_python_reply(text: str, stripped: str, strict: bool) -> ParsedMessage:
    """A reply without calls; in strict mode, flag call syntax that the model buried in prose."""
    errors = []
    if strict and ("<tool_call" in text or _CLOSE_TAG in text):
        errors.append(ERR_PY_XML_TAGS)
    elif strict and _EMBEDDED_CALL_LIST.search(text):
        errors.append(ERR_PY_EMBEDDED)
    return ParsedMessage(content=stripped, errors=errors)


def _python_failure(content: str, error: str, strict: bool) -> ParsedMessage:
    return ParsedMessage(content=content, errors=[error] if strict else [])


# ------------------------------------------------------------------------------------------------

_PARSERS = {"bfcl_qwen_fc": parse_tool_calls, "toolace_llama": parse_python_calls}


def parse_assistant(text: Any, prompt_mode: str = "bfcl_qwen_fc", strict: bool = True) -> ParsedMessage:
    """The parser that matches ``tool_prompt_mode`` (what the system prompt told the model to emit)."""
    try:
        parser = _PARSERS[prompt_mode]
    except KeyError:
        raise ValueError(f"unknown tool_prompt_mode {prompt_mode!r}; expected one of {sorted(_PARSERS)}") from None
    return parser(text, strict=strict)


__all__ = [
    "ERR_MISSING_KEYS",
    "ERR_NO_VALID_BLOCK",
    "ERR_PY_EMBEDDED",
    "ERR_PY_XML_TAGS",
    "FENCE_PATTERN",
    "MAX_ARGUMENT_DEPTH",
    "MAX_CALLS_PER_MESSAGE",
    "MAX_TEXT_CHARS",
    "TOOL_CALL_PATTERN",
    "ParsedMessage",
    "call_problem",
    "find_tool_call_blocks",
    "parse_assistant",
    "parse_python_calls",
    "parse_tool_calls",
    "shown_name",
]
