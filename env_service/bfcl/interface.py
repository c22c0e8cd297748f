"""The train-only interface: what SEAL's environment adds for the policy during training rollouts.

Three features, each a config block with the same gating (:func:`is_train_only_active`):

* ``observation_lite`` — schema cues on the tool docs of the system prompt plus the observation note; on in
  the SEAL recipe.
* ``tool_feedback_evolution`` — recovery feedback: hint lines after a rejected call
  (:func:`enrich_parse_error`) and after a tool result that is an error (:func:`enrich_tool_result`).
* ``capability_cues`` — guideline lines chosen from the failure profile the trainer pushes
  (:func:`capability_cues`), appended to the system prompt.

Everything is a pure function of (config, rollout mode, inputs): the same episode in validation mode
sees the original interface whatever the switches say (unless a block sets ``apply_to_validation``).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from env_service.vocabulary import (
    EXECUTION_ERROR_PREFIX,
    LABEL_ARGUMENT_MISMATCH,
    LABEL_INVALID_TOOL_CALL,
    LABEL_MISSING_TOOL_CALL,
    LABEL_RECOVERY_FAILURE,
    MODE_VALIDATE,
    NOT_FAILURES,
    TAG_BUDGET_EXCEEDED,
    TAG_EMPTY_TURN,
    TAG_INSTANCE_MISMATCH,
    TAG_RESPONSE_MISMATCH,
    TAG_SPURIOUS_TOOL_CALL,
    TAG_STATE_MISMATCH,
    is_execution_error,
    short_category,
)


def is_train_only_active(block_cfg: Any, mode: str | None, category: str | None = None) -> bool:
    """Whether a train-only block applies to an episode of ``mode`` and ``category``.

    Active iff ``enable``, and not (``validate`` mode and not ``apply_to_validation``), and — when the block
    lists ``categories`` — the task's category is listed. Categories may be written ``base`` or
    ``multi_turn_base`` (the released code compares the latter); both forms match either.
    """
    if block_cfg is None or not block_cfg.enable:
        return False
    if mode == MODE_VALIDATE and not block_cfg.apply_to_validation:
        return False
    categories = getattr(block_cfg, "categories", None)
    if categories:
        wanted = {short_category(c) for c in categories}
        if category is None or short_category(category) not in wanted:
            return False
    return True


# ------------------------------------------------------------------------------------------------
# observation-lite
# ------------------------------------------------------------------------------------------------


def observation_lite(tools: list[dict], cfg: Any) -> list[dict]:
    """Schema cues on a deep copy of ``tools`` (the input is never modified).

    For each tool's top-level ``parameters.properties`` (nested properties untouched): with
    ``hide_optional``, drop properties not in ``required``; then per property spec, collect in order
    ``[required]`` (if required and not already in the description), ``[type: <type>]`` (if
    ``add_type_hint``), ``Allowed values: v1, v2`` (if ``add_enum_hint`` and a non-empty ``enum``), and set
    ``description = (old + " " + " ".join(additions)).strip()``.
    """
    patched = copy.deepcopy(tools)
    for tool in patched:
        if isinstance(tool, dict):
            _annotate_tool(tool, cfg)
    return patched


def _annotate_tool(tool: dict, cfg: Any) -> None:
    func = tool.get("function", tool)  # OpenAI-style {"function": {...}} docs too, like the released code
    if not isinstance(func, dict):
        return
    params = func.get("parameters") or {}
    if not isinstance(params, dict):
        return
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    if not isinstance(props, dict):
        return
    if cfg.hide_optional:
        for name in [key for key in props if key not in required]:
            del props[name]
    for name, spec in props.items():
        if isinstance(spec, dict):
            _annotate_property(name, spec, required, cfg)


def _annotate_property(name: str, spec: dict, required: set, cfg: Any) -> None:
    desc = str(spec.get("description", "") or "")
    additions = []
    if cfg.add_required_hint and name in required and "[required]" not in desc:
        additions.append("[required]")
    if cfg.add_type_hint and spec.get("type") and "[type:" not in desc:
        additions.append(f"[type: {spec.get('type')}]")
    enum_values = spec.get("enum")
    if cfg.add_enum_hint and enum_values and "Allowed values:" not in desc:
        additions.append("Allowed values: " + ", ".join(str(v) for v in enum_values))
    if additions:
        spec["description"] = f"{desc} {' '.join(additions)}".strip()


# ------------------------------------------------------------------------------------------------
# recovery feedback (tool_feedback_evolution)
# ------------------------------------------------------------------------------------------------

_FORMAT_HINTS = {
    # The released environment's texts, verbatim.
    "bfcl_qwen_fc": (
        "[Hint] Each tool call MUST be a JSON object inside <tool_call>...</tool_call> tags with both "
        '"name" and "arguments" keys, e.g. <tool_call>{"name": "<tool>", "arguments": {"<arg>": <value>}}'
        "</tool_call>."
    ),
    "toolace_llama": (
        "[Hint] Reply with only a Python list of function calls with keyword arguments, "
        'e.g. [tool_name(arg="value")]. Do not use <tool_call> tags or JSON objects.'
    ),
}
_PLAIN_TEXT_HINT = (
    "[Hint] If no available tool can serve the user's request, reply in plain text instead of producing "
    "a malformed tool_call."
)


def shown_tool_names(tool_names: Iterable[str], max_names: int) -> list[str]:
    """Up to ``max_names`` names, then ``... (+N more)`` (``max_names`` 0 = no limit)."""
    names = [str(name) for name in tool_names]
    if max_names > 0 and len(names) > max_names:
        return names[:max_names] + [f"... (+{len(names) - max_names} more)"]
    return names


def enrich_parse_error(
    base: str,
    tool_names: Iterable[str],
    cfg: Any,
    prompt_mode: str = "bfcl_qwen_fc",
    format_hint: bool = True,
) -> str:
    """The base ``[ERROR] ...`` line plus hint lines, joined by "\\n".

    ``tool_names`` are the tools the model may call now (revealed holdouts included). ``format_hint``
    False drops the call-format line: used for calls that were well-formed but named a tool outside the
    current list (the tool list is exactly what helps there). Both differ from the released code:
    docs/upstream-differences.md.
    """
    lines = [base]
    if format_hint:
        lines.append(_FORMAT_HINTS.get(prompt_mode, _FORMAT_HINTS["bfcl_qwen_fc"]))
    shown = shown_tool_names(tool_names, cfg.max_tool_names)
    if shown:
        lines.append("[Hint] Available tools: " + ", ".join(shown) + ".")
    lines.append(_PLAIN_TEXT_HINT)
    return "\n".join(lines)


def tool_error_text(result: Any) -> str:
    """The message a recovery hint is chosen from, or "" when there is none.

    A result is an error by :func:`~env_service.vocabulary.is_execution_error`; its message is the text after
    bfcl's ``Error during execution: `` or the string under ``"error"`` of a backend's error dict (also given
    as a dict). TradingBot's ``['Error: ...']`` is an error without such a message: like the released
    detector, it gets no hint.
    """
    if isinstance(result, dict):
        error = result.get("error")
        return error if isinstance(error, str) else ""
    if not isinstance(result, str) or not is_execution_error(result):
        return ""
    if result.startswith(EXECUTION_ERROR_PREFIX):
        return result[len(EXECUTION_ERROR_PREFIX) :].strip() or result
    if result.startswith("{"):
        error = json.loads(result).get("error")  # is_execution_error found a JSON object with "error"
        return error if isinstance(error, str) else ""
    return ""


_MISSING_ARGS = re.compile(r"missing\s+\d+\s+required\s+(?:positional|keyword)\s+arguments?:\s*(.+)", re.I)
_UNEXPECTED_KWARG = re.compile(r"unexpected\s+keyword\s+argument\s*['\"]?(\w+)", re.I)
_MAX_GENERIC_ERROR_CHARS = 200
_MAX_LISTED_TOOLS = 8


def diagnose_tool_error(tool_name: str, error: str, tool_names: Iterable[str] = ()) -> str:
    """One fix hint for a tool error, or "" (the released code's order; first match wins).

    The first two texts are the released code's, verbatim; the others are ours, with the same triggers
    extended to bfcl's actual messages (e.g. ``Only one folder level at a time``, ``No user is currently logged
    in``). Argument names keep their original case (the released code lower-cases the whole error first).
    """
    text = (error or "").strip()
    if not text:
        return ""
    lo = text.lower()
    match = _MISSING_ARGS.search(text)
    if match:
        args = match.group(1).strip().rstrip(".")
        return (
            f"Required argument(s) {args} for `{tool_name}` were missing. "
            "Re-emit the tool_call with these keys present in `arguments`."
        )
    match = _UNEXPECTED_KWARG.search(text)
    if match:
        return (
            f"`{tool_name}` does not accept argument `{match.group(1)}`. "
            "Drop it and only use arguments listed in the tool schema."
        )
    if "no such directory" in lo or "no such file" in lo:
        return (
            f"The path given to `{tool_name}` does not exist in the current state. "
            "List the current directory (or read the latest results) first, then retry with an existing name."
        )
    if "you cannot use path" in lo or "use a single component" in lo or "one folder level at a time" in lo:
        return f"`{tool_name}` accepts a single path component only. Move one directory level per call."
    if _is_auth_error(lo):
        return "This call needs an authenticated session. Call the service's login/authenticate tool first, then retry."
    if "tool not found" in lo or "no such tool" in lo or "unknown function" in lo or _is_undefined_name(lo):
        names = [str(n) for n in tool_names][:_MAX_LISTED_TOOLS]
        listed = f" Available tools include: {', '.join(names)}." if names else ""
        return (
            f"`{tool_name}` is not in the available tool list.{listed} "
            "If no listed tool fits the request, reply in plain text."
        )
    if "expected" in lo and "got" in lo:
        return (
            f"`{tool_name}` received an argument of the wrong type. "
            "Check each argument's type in the tool schema (string, integer, float, list, dict)."
        )
    if len(text) < _MAX_GENERIC_ERROR_CHARS:
        return f"`{tool_name}` returned an error. Re-read its parameter schema and retry with corrected arguments."
    return ""


def _is_undefined_name(lo: str) -> bool:
    # bfcl's text for a call to a function no involved class has: "name 'foo' is not defined".
    return lo.startswith("name '") and lo.endswith("' is not defined")


def _is_auth_error(lo: str) -> bool:
    return (
        "not authenticated" in lo
        or "not logged in" in lo
        or "no user is currently logged in" in lo
        or ("login" in lo and "required" in lo)
    )


def enrich_tool_result(result: Any, tool_name: str, tool_names: Iterable[str], cfg: Any) -> str:
    """The ``[ToolHint] <hint>\\n`` line to append after this result's block, or "".

    ``cfg`` is the ``tool_feedback_evolution`` block; the caller checks :func:`is_train_only_active`.
    """
    error = tool_error_text(result)
    if not error:
        return ""
    hint = diagnose_tool_error(tool_name, error, tool_names)
    return f"[ToolHint] {hint}\n" if hint else ""


# ------------------------------------------------------------------------------------------------
# capability cues (diagnostic_evolution, fed by a pushed profile instead of a file)
# ------------------------------------------------------------------------------------------------

CUES_HEADER = "# Behavioral guidelines (env-evolved from recent failures):"

#: One guideline per failure tag: the progress tags and the paper's labels (Table 5). Keys that are both a tag
#: and a label (state_mismatch, response_mismatch) are written as tags.
DEFAULT_GUIDELINES: dict[str, str] = {
    TAG_SPURIOUS_TOOL_CALL: (
        "If none of the available functions fits the user's request, say so in plain text instead of calling a tool."
    ),
    TAG_EMPTY_TURN: (
        "When an available function can carry out the user's request, call it; do not answer with text alone."
    ),
    TAG_STATE_MISMATCH: (
        "Before a call that changes state, check the latest tool results so that its arguments match the "
        "current state, and make every change the user asked for."
    ),
    TAG_RESPONSE_MISMATCH: (
        "Look up every piece of information the user asks for with the matching tool instead of answering from memory."
    ),
    TAG_INSTANCE_MISMATCH: (
        "Only call functions of the services in the current tool list, and make sure each call actually "
        "runs without an error."
    ),
    LABEL_INVALID_TOOL_CALL: (
        "Write every tool call in the required format and use only tool names from the current tool list."
    ),
    LABEL_ARGUMENT_MISMATCH: (
        "Fill every required argument with the exact value, type and spelling given by the user or by "
        "earlier tool results."
    ),
    LABEL_RECOVERY_FAILURE: (
        "When a tool returns an error, read it, fix the cause (arguments, path or a missing earlier step) "
        "and retry before moving on."
    ),
    LABEL_MISSING_TOOL_CALL: (
        "Complete every step of the user's request with tool calls before replying; do not stop early."
    ),
    TAG_BUDGET_EXCEEDED: (
        "Make only the calls the request needs: the environment stops calls that take too long, and "
        "repeated copies, moves or searches over the same files can take very long."
    ),
}


def _tag_stats(profile: Mapping[str, Any] | None, category: str | None, per_category: bool) -> dict:
    """The ``{tag: {"count", "reward_mean"}}`` table to rank: the category's own table when asked for
    and non-empty (``base`` and ``multi_turn_base`` keys both accepted), else the global one."""
    if not isinstance(profile, Mapping):
        return {}
    if per_category and category:
        tables = profile.get("categories")
        if isinstance(tables, Mapping):
            wanted = short_category(category)
            for key, table in tables.items():
                if short_category(str(key)) == wanted and isinstance(table, Mapping) and table:
                    return dict(table)
    tags = profile.get("tags")
    return dict(tags) if isinstance(tags, Mapping) else {}


def _number(stats: Any, key: str) -> float:
    try:
        value = float(stats.get(key, 0.0) or 0.0) if isinstance(stats, Mapping) else 0.0
    except (TypeError, ValueError):
        return 0.0
    return value if value == value else 0.0  # NaN counts as 0


def select_guidelines(profile: Mapping[str, Any] | None, cfg: Any, category: str | None = None) -> list[str]:
    """The guideline sentences for the current failure profile, most pressing first.

    Failure tags only (:data:`~env_service.vocabulary.NOT_FAILURES` dropped, from the denominator too, like
    the released code). A tag qualifies with count >= ``min_tag_count``, prevalence = count / (total count of
    failure tags) >= ``prevalence_threshold`` and reward_mean < ``reward_threshold``; ranking by
    prevalence * (1 - reward_mean) (ties: tag name); at most ``max_lines``.
    """
    table = _tag_stats(profile, category, cfg.per_category)
    stats = {tag: s for tag, s in table.items() if tag not in NOT_FAILURES}
    total = sum(max(0.0, _number(s, "count")) for s in stats.values())
    if total <= 0:
        return []
    guidelines = dict(DEFAULT_GUIDELINES)
    for tag, text in (cfg.guidelines or {}).items():
        if text is None:
            guidelines.pop(tag, None)
        elif text.strip():
            guidelines[tag] = text.strip()
    ranked = []
    for tag, s in stats.items():
        count, reward_mean = _number(s, "count"), _number(s, "reward_mean")
        prevalence = count / total
        if (
            tag in guidelines
            and count >= cfg.min_tag_count
            and prevalence >= cfg.prevalence_threshold
            and reward_mean < cfg.reward_threshold
        ):
            ranked.append((-prevalence * (1.0 - reward_mean), tag))
    ranked.sort()
    return [guidelines[tag] for _, tag in ranked[: cfg.max_lines]]


def capability_cues(profile: Mapping[str, Any] | None, cfg: Any, category: str | None = None) -> str:
    """The system-prompt block: header plus one ``- <guideline>`` line each; "" if nothing qualifies.

    ``cfg`` is the ``capability_cues`` block; the caller checks :func:`is_train_only_active`.
    """
    lines = select_guidelines(profile, cfg, category)
    if not lines:
        return ""
    return CUES_HEADER + "\n" + "\n".join(f"- {line}" for line in lines)


__all__ = [
    "CUES_HEADER",
    "DEFAULT_GUIDELINES",
    "capability_cues",
    "diagnose_tool_error",
    "enrich_parse_error",
    "enrich_tool_result",
    "is_train_only_active",
    "observation_lite",
    "select_guidelines",
    "shown_tool_names",
    "tool_error_text",
]
