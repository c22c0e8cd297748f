"""Every text the environment shows the model, byte for byte as the released environment shows it.

The constant texts come from bfcl-eval 2026.3.23 (``bfcl_eval.constants.default_prompts`` and
``bfcl_eval.utils._get_language_specific_hint``); they are written out here rather than imported
because only ``env_service.bfcl.upstream`` may import bfcl internals. ``tests/env/test_episode.py`` checks them
against the installed package.

Nothing here mutates its inputs: tool docs belong to the task (and, through ``tasks.load_task``'s copy,
to one episode), so every transformation builds new dicts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from env_service.control_text import SERVICE_MARKUP
from env_service.vocabulary import INVALID_TOOL_CALL_PREFIX

# --- fixed texts -------------------------------------------------------------------------------

#: The environment's message when the last question turn has been answered.
CONVERSATION_COMPLETED = "[CONVERSATION_COMPLETED]"

#: The released recipe's default observation-lite instruction, verbatim.
OBSERVATION_NOTE = (
    "Observation note: parameters marked [required] must be provided exactly when calling a tool; "
    "do not invent tools outside the current schema."
)

#: bfcl ``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC`` (the tail of the reveal message).
ADDITIONAL_FUNCTION_PROMPT = "I have updated some more functions you can choose from. What about now?"

#: bfcl ``_get_language_specific_hint`` for Python categories. The released environment's ``_compile_tools``
#: appends it in place to every doc at each user turn; the docs rendered in the reveal message have
#: been through exactly one such call, hence exactly one suffix there and nowhere else.
PYTHON_SYNTAX_HINT = " Note that the provided function is in Python 3 syntax."

# --- bfcl_qwen_fc --------------------------------------------------------------------------------

_QWEN_FC_HEADER = (
    "# Tools\n",
    "You may call one or more functions to assist with the user query.\n",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "<tools>",
)
_QWEN_FC_FOOTER = (
    "</tools>\n",
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:",
    "<tool_call>",
    '{"name": <function-name>, "arguments": <args-json-object>}',
    "</tool_call>",
)


def qwen_fc_tools_prompt(tools: list[dict]) -> str:
    """bfcl QwenFCHandler's tool block without ``<|im_end|>``; "" for no tools.

    One ``json.dumps(tool)`` per line with Python's defaults (ASCII escapes, ", " and ": ").
    """
    if not tools:
        return ""
    lines = [*_QWEN_FC_HEADER, *(json.dumps(tool) for tool in tools), *_QWEN_FC_FOOTER]
    return "\n".join(lines)


# --- toolace_llama -------------------------------------------------------------------------------
# bfcl scores Team-ACE/ToolACE-2-8B with its LlamaHandler in prompting mode, i.e. the default system
# prompt ``formulate_system_prompt(DEFAULT_SYSTEM_PROMPT_FORMAT, functions)`` ("classic" style,
# plaintext template, Python call-list output, docs as ``json.dumps(docs, indent=4)``). We reproduce
# that text exactly so the ToolACE backbone sees the format it was trained and benchmarked with. The
# model then answers with ``[func(a=1), other(b="x")]``, which ``parser.parse_python_calls`` reads with
# ``ast`` (literal arguments only, never evaluated).

_TOOLACE_PERSONA = "You are an expert in composing functions."
_TOOLACE_TASK = (
    "You are given a question and a set of possible functions. Based on the question, you will need to "
    "make one or more function/tool calls to achieve the purpose. If none of the functions can be used, "
    "point it out. If the given question lacks the parameters required by the function, also point it out."
)
_TOOLACE_CALL_FORMAT = (
    "You should only return the function calls in your response.\n\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]. "
    # bfcl's template is "{output_format}. {param_types} You SHOULD ..." with empty param_types for
    # Python output, hence the double space.
    " You SHOULD NOT include any other text in the response."
)
_TOOLACE_MULTITURN = (
    "At each turn, you should try your best to complete the tasks requested by the user within the "
    "current turn. Continue to output functions to call until you have fulfilled the user's request to "
    "the best of your ability. Once you have no more functions to call, the system will consider the "
    "current turn complete and proceed to the next turn or task."
)


def toolace_tools_prompt(tools: list[dict]) -> str:
    """bfcl's default prompting system prompt for these tools; "" for no tools."""
    if not tools:
        return ""
    docs = json.dumps(tools, indent=4)
    available = f"Here is a list of functions in json format that you can invoke.\n{docs}\n"
    # bfcl's plaintext template:
    # "{persona}{task}\n\n{tool_call_format}\n\n{multiturn_behavior}\n\n{available_tools}"
    sections = [_TOOLACE_PERSONA + _TOOLACE_TASK, _TOOLACE_CALL_FORMAT, _TOOLACE_MULTITURN, available]
    return "\n\n".join(sections)


_TOOL_PROMPT_BUILDERS = {
    "bfcl_qwen_fc": qwen_fc_tools_prompt,
    "toolace_llama": toolace_tools_prompt,
}


def tools_system_prompt(tools: list[dict], mode: str = "bfcl_qwen_fc") -> str:
    """The tool part of the system prompt for ``tool_prompt_mode`` ``mode`` ("" for no tools)."""
    try:
        builder = _TOOL_PROMPT_BUILDERS[mode]
    except KeyError:
        raise ValueError(
            f"unknown tool_prompt_mode {mode!r}; expected one of {sorted(_TOOL_PROMPT_BUILDERS)}"
        ) from None
    return builder(tools)


def system_content(tool_prompt: str, extra_blocks: Iterable[str] = ()) -> str:
    """The tool prompt, then each non-empty extra block after a blank line.

    Extra blocks are, in order, the observation note (observation-lite active) and the capability-cue
    block (non-empty). Blocks are stripped like the released environment's instruction.
    """
    blocks = [block.strip() for block in extra_blocks if block and block.strip()]
    if not blocks:
        return tool_prompt
    return tool_prompt + "\n\n" + "\n\n".join(blocks)


# --- turn messages -------------------------------------------------------------------------------


def with_python_hint(doc: dict) -> dict:
    """A copy of ``doc`` whose description carries one :data:`PYTHON_SYNTAX_HINT` (key order kept)."""
    out = dict(doc)
    out["description"] = f"{doc.get('description', '')}{PYTHON_SYNTAX_HINT}"
    return out


def reveal_message(docs: list[dict]) -> str:
    """The user message of a holdout (missing-function) turn.

    = bfcl ``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=json.dumps(docs,
    ensure_ascii=False))`` where each doc carries one Python-syntax suffix and no observation hints.
    """
    shown = [with_python_hint(doc) for doc in docs]
    return json.dumps(shown, ensure_ascii=False) + "\n" + ADDITIONAL_FUNCTION_PROMPT


def invalid_tool_call_message(error: str) -> str:
    """``[ERROR] Invalid tool call format: <error>``: every rejection (parse error, unavailable tool, bad call)."""
    return INVALID_TOOL_CALL_PREFIX + error


def _result_text(content: Any) -> str:
    # Executor results are strings already; anything else is JSON-dumped like the released environment does.
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def render_tool_result(content: Any, mode: str = "bfcl_tool_response") -> str:
    """One tool result as it appears inside the environment's reply.

    ``bfcl_tool_response``: ``<tool_response>\\n{content}\\n</tool_response>\\n``; the
    blocks of one step are concatenated into one user message. ``ipython``: the bare result plus "\\n".
    The result is data: the framing's tags in it are escaped, so the only ones in the reply are the framing's
    (``env_service/control_text.py``).
    """
    text = SERVICE_MARKUP.escape(_result_text(content))
    if mode == "bfcl_tool_response":
        return f"<tool_response>\n{text}\n</tool_response>\n"
    if mode == "ipython":
        return text + "\n"
    raise ValueError(f"unknown tool_result_mode {mode!r}; expected bfcl_tool_response or ipython")


def tool_result_role(mode: str) -> str:
    """The chat role of the environment's reply after tool calls (``user`` except in ``ipython`` mode)."""
    return "ipython" if mode == "ipython" else "user"


def tool_result_messages(results: list[str], mode: str) -> list[str]:
    """The reply's messages from the rendered results of one assistant message.

    ``bfcl_tool_response``: one message, the results concatenated. ``ipython``: one message per result without
    its trailing newline, as bfcl's Llama handler sends each execution result as its own ``ipython`` turn.
    """
    if mode == "ipython":
        return [text[:-1] if text.endswith("\n") else text for text in results]
    return ["".join(results)]


__all__ = [
    "ADDITIONAL_FUNCTION_PROMPT",
    "CONVERSATION_COMPLETED",
    "OBSERVATION_NOTE",
    "PYTHON_SYNTAX_HINT",
    "invalid_tool_call_message",
    "qwen_fc_tools_prompt",
    "render_tool_result",
    "reveal_message",
    "system_content",
    "tool_result_messages",
    "tool_result_role",
    "tools_system_prompt",
    "toolace_tools_prompt",
    "with_python_hint",
]
