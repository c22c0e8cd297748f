"""Parser tests: the released environment's rules and exact error texts, the linear matcher's equivalence with upstream's
regular expression, robustness on hostile input, and the Python call-list parser (toolace_llama)."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from env_service.bfcl.calls import ToolCall
from env_service.bfcl.parser import (
    ERR_MISSING_KEYS,
    ERR_NO_VALID_BLOCK,
    ERR_PY_EMBEDDED,
    ERR_PY_XML_TAGS,
    FENCE_PATTERN,
    MAX_ARGUMENT_DEPTH,
    MAX_CALLS_PER_MESSAGE,
    MAX_TEXT_CHARS,
    TOOL_CALL_PATTERN,
    _fenced,
    _strip_fence,
    find_tool_call_blocks,
    parse_assistant,
    parse_python_calls,
    parse_tool_calls,
)


def block(payload: str) -> str:
    return f"<tool_call>\n{payload}\n</tool_call>"


def json_error(text: str) -> str:
    """The message Python's json module gives for ``text`` (what upstream puts after the prefix)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return str(exc)
    raise AssertionError("expected invalid JSON")


# --- exact error texts -----------------------------------------------------------------------


def test_error_texts_are_specs():
    assert ERR_NO_VALID_BLOCK == "Found tool_call tag text, but no valid <tool_call>{...}</tool_call> block."
    assert ERR_MISSING_KEYS == "Tool call JSON must contain both 'name' and 'arguments'."


def test_valid_calls_with_content_and_ids():
    text = (
        "Let me check.\n\n\n"
        + block('{"name": "ls", "arguments": {"a": true}}')
        + "\n"
        + block('{"name": "cd", "arguments": {"folder": "x"}}')
        + "\n\n\nDone"
    )
    parsed = parse_tool_calls(text)
    assert parsed.errors == []
    assert parsed.calls == [ToolCall("ls", {"a": True}), ToolCall("cd", {"folder": "x"})]
    assert parsed.call_ids == ["ls_1", "cd_2"]
    # blocks removed, stripped, runs of blank lines collapsed to one blank line
    assert parsed.content == "Let me check.\n\nDone"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call> no json",
        "</tool_call>",
        "<tool_call>[1, 2]</tool_call>x",
        "<tool_call_x>",
        "<tool_call>{}",
    ],
)
def test_tag_without_valid_block(text):
    parsed = parse_tool_calls(text)
    assert parsed.calls == [] and parsed.errors == [ERR_NO_VALID_BLOCK]
    assert parsed.content == text.strip()
    assert parse_tool_calls(text, strict=False).errors == []


def test_plain_text_has_no_error():
    parsed = parse_tool_calls("  The answer is 42.  ")
    assert (parsed.content, parsed.calls, parsed.errors) == ("The answer is 42.", [], [])


@pytest.mark.parametrize("bad", ['{"name": "ls", "arguments": {}', "{name: 1}", '{"a": 1,}', '{"a": nan-}'])
def test_invalid_json(bad):
    # A block must end in "}" to match; the JSON inside is invalid.
    payload = bad if bad.endswith("}") else bad + "}"
    parsed = parse_tool_calls(block(payload))
    assert parsed.errors == [f"Invalid tool call JSON: {json_error(payload)}"]
    assert parsed.calls == []


def test_non_object_json_is_skipped_silently():
    # "{...}" can only match objects, but strings/numbers inside braces are not possible; a JSON array
    # never matches the pattern. An object that is valid but wrapped as a JSON string literal is not an
    # object either: use a top-level value that json.loads returns as non-dict via a nested match.
    parsed = parse_tool_calls(block('{"name": "ls", "arguments": {}}') + block("{}"))
    assert parsed.errors == [ERR_MISSING_KEYS]
    # a message whose only block decodes to a non-dict: impossible with "{...}", so check the reader
    from env_service.bfcl.parser import _read_block

    assert _read_block('"just a string"', strict=True) == (None, None)
    assert _read_block("[1, 2]", strict=True) == (None, None)


@pytest.mark.parametrize("payload", ['{"name": "ls"}', '{"arguments": {}}', "{}"])
def test_missing_name_or_arguments(payload):
    assert parse_tool_calls(block(payload)).errors == [ERR_MISSING_KEYS]


def test_string_arguments_are_decoded_in_strict_mode():
    parsed = parse_tool_calls(block('{"name": "cd", "arguments": "{\\"folder\\": \\"x\\"}"}'))
    assert parsed.calls == [ToolCall("cd", {"folder": "x"})] and parsed.errors == []
    lenient = parse_tool_calls(block('{"name": "cd", "arguments": "{\\"folder\\": \\"x\\"}"}'), strict=False)
    assert lenient.calls == [ToolCall("cd", '{"folder": "x"}')]  # passed on as given


def test_non_json_string_arguments():
    parsed = parse_tool_calls(block('{"name": "cd", "arguments": "folder=x"}'))
    assert parsed.errors == ["Tool 'cd' has non-JSON string arguments."]


@pytest.mark.parametrize("arguments", ["[1]", "3", "null", "true", '"\\"text\\""'])
def test_arguments_must_be_object(arguments):
    parsed = parse_tool_calls(block(f'{{"name": "cd", "arguments": {arguments}}}'))
    assert parsed.errors == ["Tool 'cd' arguments must be a JSON object."]
    assert parsed.calls == []


def test_errors_in_order_and_joined():
    text = "".join(
        block(p) for p in ['{"name": "a"}', '{"name": "b", "arguments": 1}', '{"name": "c", "arguments": {}}']
    )
    parsed = parse_tool_calls(text)
    assert parsed.errors == [ERR_MISSING_KEYS, "Tool 'b' arguments must be a JSON object."]
    assert parsed.error_text == f"{ERR_MISSING_KEYS}; Tool 'b' arguments must be a JSON object."
    assert parsed.calls == [ToolCall("c", {})]  # valid calls are still reported (the episode rejects all)


def test_lenient_mode_reports_no_errors():
    text = block('{"name": "a"}') + block("{bad}") + block('{"name": "c", "arguments": {}}')
    parsed = parse_tool_calls(text, strict=False)
    assert parsed.errors == [] and parsed.calls == [ToolCall("c", {})]


def test_non_string_names_are_kept_for_the_episode_to_reject():
    parsed = parse_tool_calls(block('{"name": 5, "arguments": {}}'))
    assert parsed.calls == [ToolCall(5, {})] and parsed.call_ids == ["5_1"]


# --- the linear matcher equals upstream's regex --------------------------------------------------

_ALPHABET = ["<tool_call>", "</tool_call>", "{", "}", " ", "\n", "\t", "\u00a0", '"', "a", "<", ":", "1"]


def _regex_blocks(text: str) -> list[tuple[int, int, str]]:
    return [(m.start(), m.end(), m.group(1)) for m in re.finditer(TOOL_CALL_PATTERN, text, re.DOTALL)]


def test_matcher_equals_upstream_regex_on_random_inputs():
    rng = random.Random(1234)
    for _ in range(4000):
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 30)))
        assert find_tool_call_blocks(text) == _regex_blocks(text), text


def test_matcher_equals_regex_on_realistic_messages():
    samples = [
        block('{"name": "ls", "arguments": {}}') * 3,
        '<tool_call>{"a": {"b": 1}}</tool_call> tail </tool_call>',
        '<tool_call> \n {"a": 1} } \n </tool_call>',
        '<tool_call>{}</tool_call><tool_call>{"x": "</tool_call>"}</tool_call>',
        '<tool_call><tool_call>{"a": 1}</tool_call>',
        '<tool_call>\n\n{"a": 1}\n\n\n</tool_call>',
    ]
    for text in samples:
        assert find_tool_call_blocks(text) == _regex_blocks(text)


def test_whitespace_definition_matches_regex():
    # the matcher uses str.isspace for the regex's \s
    for code in range(0x3000 + 1):
        ch = chr(code)
        assert (re.fullmatch(r"\s", ch) is not None) == ch.isspace(), hex(code)


# --- the fence reader equals the pattern it replaces (linear; the pattern is cubic on blanks: test_parser_cost.py) ---

_FENCE_ALPHABET = ["`", "```", " ", "\t", "\n", "\r", "a", "-", "_", "1", "\u00e9", "\u00a0", "[", "("]
_FENCE_ENDS = ["```", "```\n", " ```", "\n```", "\n \t```\n", "``", ""]


def _regex_fenced(text: str) -> str | None:
    match = re.match(FENCE_PATTERN, text, re.DOTALL)
    return match.group(1) if match else None


def test_fence_reader_equals_the_pattern_on_random_inputs():
    rng = random.Random(41)
    for _ in range(20_000):
        text = "".join(rng.choice(_FENCE_ALPHABET) for _ in range(rng.randint(0, 12)))
        text = ("```" if rng.random() < 0.8 else "") + text + rng.choice(_FENCE_ENDS)
        assert _fenced(text) == _regex_fenced(text), repr(text)


@pytest.mark.parametrize(
    "text",
    [
        "```python\n[ls(a=True)]\n```",
        "```\n[cd(folder='doc')]\n```",
        "```py [ls()] ```",
        "```tool_code\n  [ls()]  \n```\n",
        "```\n```",
        "``````",
        "```",
        "```json\n",
        "[ls()]",
    ],
)
def test_fenced_replies_read_as_before(text):
    expected = _regex_fenced(text)
    assert _strip_fence(text) == (text if expected is None else expected.strip())


# --- robustness ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        None,
        12,
        b"<tool_call>{}</tool_call>",
        '\ud800<tool_call>\n{"name": "\udfff", "arguments": {"x": "\ud83d"}}\n</tool_call>',
        '<tool_call>\x00{"name": 1}</tool_call>',
        "<tool_call>" * 5000,
    ],
)
def test_never_raises(text):
    for strict in (True, False):
        parse_tool_calls(text, strict=strict)
        parse_python_calls(text, strict=strict)


@pytest.mark.parametrize(
    "parse, text",
    [
        (parse_tool_calls, block('{"name": "echo", "arguments": {"content": "\\ud800"}}')),
        (parse_tool_calls, block('{"name": "echo", "arguments": {"x\\udfff": "a"}}')),
        (parse_tool_calls, block('{"name": "\\ud83d", "arguments": {}}')),
        (parse_tool_calls, block('{"name": "echo", "arguments": {"content": ["ok", {"a": "\\ud800"}]}}')),
        (parse_python_calls, "[echo(content='\\ud800')]"),
        (parse_python_calls, "[echo(content=['ok', {'a': '\\udfff'}])]"),
    ],
)
def test_lone_surrogates_are_refused_in_every_format(parse, text):
    """An escape can turn valid message text into a lone surrogate; no call carrying one is read (it would be kept, run,
    snapshotted and echoed as text nothing downstream can encode)."""
    assert "\\ud" in text and text.encode("utf-8")  # the message itself is valid text
    parsed = parse(text)
    assert parsed.calls == []
    assert len(parsed.errors) == 1 and "lone surrogate" in parsed.errors[0], parsed.errors
    assert parse(text, strict=False).calls == []


def test_surrogate_pair_escapes_are_one_valid_character():
    parsed = parse_tool_calls(block('{"name": "echo", "arguments": {"content": "\\ud83d\\ude00"}}'))
    assert parsed.errors == [] and parsed.calls == [ToolCall("echo", {"content": "\U0001f600"})]
    assert parse_python_calls("[echo(content='\\ud83d\\ude00')]").errors  # in Python source: two lone surrogates


def test_deeply_nested_json_is_a_clean_error():
    deep = '{"name": "a", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    parsed = parse_tool_calls(block(deep))
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("Invalid tool call JSON: maximum recursion depth")


def test_argument_depth_cap():
    def nested(depth: int) -> str:  # the arguments object is level 1
        return '{"name": "a", "arguments": {"x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}}"

    ok, too_deep = nested(MAX_ARGUMENT_DEPTH), nested(MAX_ARGUMENT_DEPTH + 1)
    assert parse_tool_calls(block(ok)).errors == []
    assert parse_tool_calls(block(too_deep)).errors == [
        f"Tool 'a' arguments are nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)."
    ]


def test_size_caps():
    huge = "<tool_call>" + "x" * MAX_TEXT_CHARS
    assert parse_tool_calls(huge).errors == [
        f"Assistant message too long ({len(huge)} characters > {MAX_TEXT_CHARS}); it was not parsed."
    ]
    assert parse_tool_calls(huge, strict=False).errors == []
    many = block('{"name": "ls", "arguments": {}}') * (MAX_CALLS_PER_MESSAGE + 1)
    parsed = parse_tool_calls(many)
    n = MAX_CALLS_PER_MESSAGE
    assert parsed.errors == [f"Too many tool calls in one message ({n + 1} > {n})."]
    assert len(parse_tool_calls(many, strict=False).calls) == MAX_CALLS_PER_MESSAGE


def test_long_names_are_shortened_in_errors():
    name = "n" * 5000
    parsed = parse_tool_calls(block(json.dumps({"name": name, "arguments": 1})))
    assert parsed.errors == [f"Tool '{'n' * 200}...' arguments must be a JSON object."]


def test_degenerate_repetition_is_linear():
    # unterminated repeated blocks: quadratic for the backtracking regex, linear here
    text = '<tool_call>\n{"name": "ls", "arguments": {}}\n' * 40_000  # ~1.6 MB would exceed the cap; use 1 MB
    text = text[: MAX_TEXT_CHARS - 1]
    start = time.perf_counter()
    parsed = parse_tool_calls(text)
    assert time.perf_counter() - start < 2.0
    assert parsed.errors == [ERR_NO_VALID_BLOCK]


# --- Python call lists (toolace_llama) -----------------------------------------------------------


def test_python_calls_basic():
    parsed = parse_python_calls("[cd(folder='doc'), ls(a=True), mean(numbers=[1, 2.5, -3])]")
    assert parsed.errors == [] and parsed.content == ""
    assert parsed.calls == [
        ToolCall("cd", {"folder": "doc"}),
        ToolCall("ls", {"a": True}),
        ToolCall("mean", {"numbers": [1, 2.5, -3]}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "cd(folder='doc')",
        "```python\n[cd(folder='doc')]\n```",
        "```\ncd(folder='doc')\n```",
        "  [cd(folder='doc')]\n",
    ],
)
def test_python_call_forms(text):
    assert parse_python_calls(text).calls == [ToolCall("cd", {"folder": "doc"})]


def test_python_tuples_become_lists_and_nested_values_survive():
    parsed = parse_python_calls("[f(a=(1, 2), b={'k': (None, 'v')})]")
    assert parsed.calls == [ToolCall("f", {"a": [1, 2], "b": {"k": [None, "v"]}})]


@pytest.mark.parametrize(
    "text, error",
    [
        ("[cd('doc')]", "Tool 'cd' uses positional arguments; pass every argument as name=value."),
        ("[cd(**{'folder': 'doc'})]", "Tool 'cd' uses **kwargs, which is not supported."),
        ("[cd(folder=__import__('os').getpid())]", "Tool 'cd' argument 'folder' is not a literal value."),
        ("[cd(folder=x)]", "Tool 'cd' argument 'folder' is not a literal value."),
        ("[cd(folder=1 + 2)]", "Tool 'cd' argument 'folder' is not a literal value."),
        ("[cd(folder={1, 2})]", "Tool 'cd' argument 'folder' is not a JSON-like literal value."),
        ("[cd(folder=b'x')]", "Tool 'cd' argument 'folder' is not a JSON-like literal value."),
        ("[cd(folder='a'), 3]", "The function-call list contains an item that is not a function call."),
        ("[f(a=1)(b=2)]", "A function call has an invalid function name."),
        ("[cd(folder='a'", ERR_PY_EMBEDDED),  # a truncated list
        ("[cd(folder='a', folder='b')]", "Tool 'cd' repeats argument 'folder'."),
        (
            "cd(folder='a'))",
            "Invalid function-call syntax: closing parenthesis ')' does not match opening parenthesis '['",
        ),
    ],
)
def test_python_call_errors(text, error):
    parsed = parse_python_calls(text)
    assert error in parsed.errors, parsed.errors
    assert parse_python_calls(text, strict=False).errors == []


@pytest.mark.parametrize(
    "text",
    [
        "Sure, here is the plan.",
        "[Note] nothing to do",
        "[]",
        "[1, 2, 3]",
        "The list is [a, b]",
        "f (x) is nice",
    ],
)
def test_python_plain_replies(text):
    parsed = parse_python_calls(text)
    assert parsed.calls == [] and parsed.errors == [] and parsed.content == text.strip()


def test_python_buried_calls_and_xml_tags_are_errors_in_strict_mode():
    buried = parse_python_calls("I will now run [cd(folder='doc')] for you.")
    assert buried.errors == [ERR_PY_EMBEDDED]
    assert ERR_PY_EMBEDDED == (
        "Found function-call syntax, but the reply is not exactly one list [func_name(arg=value), ...]; "
        "reply with only that list, or with plain text."
    )
    xml = parse_python_calls(block('{"name": "cd", "arguments": {}}'))
    assert xml.errors == [ERR_PY_XML_TAGS]
    assert ERR_PY_XML_TAGS == (
        "This prompt format expects a Python function-call list like [func_name(arg=value)], not <tool_call> tags."
    )
    assert parse_python_calls("I will now run [cd(folder='doc')]", strict=False).errors == []


def test_parse_assistant_dispatch():
    assert parse_assistant("[cd(folder='a')]", "toolace_llama").calls == [ToolCall("cd", {"folder": "a"})]
    assert parse_assistant(block('{"name": "cd", "arguments": {}}')).calls == [ToolCall("cd", {})]
    with pytest.raises(ValueError, match="tool_prompt_mode"):
        parse_assistant("x", "nope")
