"""Train-only interface: gating, observation-lite, recovery feedback, capability cues."""

from __future__ import annotations

import copy

import pytest

from env_service.bfcl.config import CapabilityCuesConfig, ObservationLiteConfig, ToolFeedbackConfig
from env_service.bfcl.interface import (
    CUES_HEADER,
    DEFAULT_GUIDELINES,
    capability_cues,
    diagnose_tool_error,
    enrich_parse_error,
    enrich_tool_result,
    is_train_only_active,
    observation_lite,
    select_guidelines,
    tool_error_text,
)

# --- gating --------------------------------------------------------------------------------------


def test_validate_mode_disables_unless_apply_to_validation():
    assert not is_train_only_active(ObservationLiteConfig(enable=True), "validate", "base")
    assert is_train_only_active(ObservationLiteConfig(enable=True, apply_to_validation=True), "validate", "base")


def test_train_mode_enables():
    assert is_train_only_active(ObservationLiteConfig(enable=True), "train", "base")
    assert not is_train_only_active(ObservationLiteConfig(enable=False), "train", "base")


@pytest.mark.parametrize(
    "categories, category, active",
    [
        (("base",), "base", True),
        (("multi_turn_base",), "base", True),
        (("base",), "multi_turn_base", True),
        (("miss_func", "long_context"), "base", False),
        (("miss_func",), None, False),
        ((), "base", True),  # empty list = no filter, like upstream
    ],
)
def test_category_filter(categories, category, active):
    cfg = ToolFeedbackConfig(enable=True, categories=categories)
    assert is_train_only_active(cfg, "train", category) is active


# --- observation-lite ----------------------------------------------------------------------------

TOOLS = [
    {
        "name": "cd",
        "description": "Change directory.",
        "parameters": {
            "type": "dict",
            "properties": {
                "folder": {"type": "string", "description": "The folder."},
                "mode": {"type": "string", "description": "Mode.", "enum": ["fast", 2]},
                "opt": {"type": "integer", "description": "Optional [required] flag."},
                "nested": {
                    "type": "dict",
                    "description": "Nested.",
                    "properties": {"inner": {"type": "string", "description": "Inner."}},
                    "required": ["inner"],
                },
            },
            "required": ["folder", "mode", "nested"],
        },
        "response": {"type": "dict", "properties": {}},
    },
    {
        "name": "pwd",
        "description": "Print.",
        "parameters": {"type": "dict", "properties": {}, "required": []},
    },
]


def props(tools, i=0):
    return tools[i]["parameters"]["properties"]


def test_observation_lite_defaults():
    original = copy.deepcopy(TOOLS)
    out = observation_lite(TOOLS, ObservationLiteConfig(enable=True))
    assert TOOLS == original  # input untouched
    p = props(out)
    assert p["folder"]["description"] == "The folder. [required]"
    assert p["mode"]["description"] == "Mode. [required] Allowed values: fast, 2"
    assert p["opt"]["description"] == "Optional [required] flag."  # not required: untouched
    assert p["nested"]["description"] == "Nested. [required]"
    assert p["nested"]["properties"]["inner"]["description"] == "Inner."  # nested untouched
    assert out[1] == TOOLS[1]


def test_observation_lite_type_hint_hide_optional_and_switches():
    cfg = ObservationLiteConfig(enable=True, add_type_hint=True, hide_optional=True, add_enum_hint=False)
    p = props(observation_lite(TOOLS, cfg))
    assert list(p) == ["folder", "mode", "nested"]
    assert p["folder"]["description"] == "The folder. [required] [type: string]"
    assert p["mode"]["description"] == "Mode. [required] [type: string]"
    none = ObservationLiteConfig(enable=True, add_required_hint=False, add_enum_hint=False)
    assert observation_lite(TOOLS, none) == TOOLS


def test_observation_lite_is_idempotent_on_marked_descriptions():
    cfg = ObservationLiteConfig(enable=True)
    once = observation_lite(TOOLS, cfg)
    assert observation_lite(once, cfg) == once


def test_observation_lite_empty_description_and_openai_style():
    params = {"properties": {"a": {"type": "x"}}, "required": ["a"]}
    tools = [{"function": {"name": "f", "parameters": params}}]
    out = observation_lite(tools, ObservationLiteConfig(enable=True))
    assert out[0]["function"]["parameters"]["properties"]["a"]["description"] == "[required]"


# --- recovery feedback ---------------------------------------------------------------------------


def test_enrich_parse_error_exact_text():
    names = [f"t{i}" for i in range(14)]
    text = enrich_parse_error("[ERROR] Invalid tool call format: X", names, ToolFeedbackConfig(enable=True))
    assert text == "\n".join(
        [
            "[ERROR] Invalid tool call format: X",
            "[Hint] Each tool call MUST be a JSON object inside <tool_call>...</tool_call> tags "
            'with both "name" and "arguments" keys, e.g. '
            '<tool_call>{"name": "<tool>", "arguments": {"<arg>": <value>}}</tool_call>.',
            "[Hint] Available tools: t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, ... (+2 more).",
            "[Hint] If no available tool can serve the user's request, "
            "reply in plain text instead of producing a malformed tool_call.",
        ]
    )


def test_enrich_parse_error_variants():
    cfg = ToolFeedbackConfig(enable=True, max_tool_names=0)
    no_names = enrich_parse_error("B", [], cfg).split("\n")
    assert len(no_names) == 3 and not any("Available tools" in line for line in no_names)
    all_names = enrich_parse_error("B", ["a", "b"], cfg, format_hint=False).split("\n")
    assert all_names == [
        "B",
        "[Hint] Available tools: a, b.",
        "[Hint] If no available tool can serve the user's request, "
        "reply in plain text instead of producing a malformed tool_call.",
    ]
    toolace = enrich_parse_error("B", ["a"], cfg, prompt_mode="toolace_llama").split("\n")
    assert toolace[1].startswith("[Hint] Reply with only a Python list of function calls")


@pytest.mark.parametrize(
    "result, error",
    [
        ('{"error": "cd: \'x\': No such file or directory"}', "cd: 'x': No such file or directory"),
        ({"error": "boom"}, "boom"),
        (
            "Error during execution: GorillaFileSystem.cd() missing 1 required positional argument: 'folder'",
            "GorillaFileSystem.cd() missing 1 required positional argument: 'folder'",
        ),
        ('{"current_directory_content": ["a"]}', ""),
        ('{"error": 5}', ""),
        ('{"error": "unterminated', ""),
        ("plain text mentioning error", ""),
        (None, ""),
        ("['Error: not a dict']", ""),
    ],
)
def test_tool_error_text(result, error):
    assert tool_error_text(result) == error


@pytest.mark.parametrize(
    "error, expected",
    [
        (
            "GorillaFileSystem.cd() missing 1 required positional argument: 'folder'",
            "Required argument(s) 'folder' for `cd` were missing. "
            "Re-emit the tool_call with these keys present in `arguments`.",
        ),
        (
            "VehicleControlAPI.fillFuelTank() missing 1 required positional argument: 'fuelAmount'",
            "Required argument(s) 'fuelAmount' for `cd` were missing. "
            "Re-emit the tool_call with these keys present in `arguments`.",
        ),
        (
            "GorillaFileSystem.cd() got an unexpected keyword argument 'path'",
            "`cd` does not accept argument `path`. Drop it and only use arguments listed in the tool schema.",
        ),
        ("cd: 'x': No such file or directory", "The path given to `cd` does not exist in the current state."),
        (
            "cd: a/b: Unsupported path. Only one folder level at a time is supported.",
            "`cd` accepts a single path component only. Move one directory level per call.",
        ),
        ("User not authenticated. Please authenticate before posting.", "This call needs an authenticated session."),
        ("No user is currently logged in.", "This call needs an authenticated session."),
        ("name 'foo' is not defined", "`cd` is not in the available tool list. Available tools include: a, b."),
        ("expected str, got int", "`cd` received an argument of the wrong type."),
        ("Stock with symbol 'X' not found.", "`cd` returned an error. Re-read its parameter schema"),
        ("x" * 300, ""),
    ],
)
def test_diagnose_tool_error(error, expected):
    hint = diagnose_tool_error("cd", error, ["a", "b"])
    if expected:
        assert hint.startswith(expected), hint
    else:
        assert hint == ""


def test_diagnose_order_first_match_wins():
    # "No such directory" and "you cannot use path" both present: the path hint comes first (the released order)
    hint = diagnose_tool_error("cd", "cd: tmp: No such directory. You cannot use path to change directory.")
    assert hint.startswith("The path given to `cd`")


def test_tool_not_found_lists_at_most_eight_tools():
    hint = diagnose_tool_error("x", "tool not found", [f"t{i}" for i in range(20)])
    assert "Available tools include: t0, t1, t2, t3, t4, t5, t6, t7." in hint


def test_enrich_tool_result_line():
    cfg = ToolFeedbackConfig(enable=True)
    line = enrich_tool_result('{"error": "No user is currently logged in."}', "post_tweet", [], cfg)
    assert line.startswith("[ToolHint] This call needs an authenticated session.") and line.endswith("\n")
    assert enrich_tool_result('{"ok": true}', "post_tweet", [], cfg) == ""


# --- capability cues -----------------------------------------------------------------------------


def profile(tags, categories=None, step=3):
    return {"step": step, "tags": tags, "categories": categories or {}}


CUES = CapabilityCuesConfig(enable=True)


def test_cues_select_rank_and_format():
    p = profile(
        {
            "pass": {"count": 1000, "reward_mean": 1.0},  # excluded (also from the denominator)
            "state_mismatch": {"count": 40, "reward_mean": 0.0},  # prevalence .4, pressure .4
            "empty_turn_model_response": {"count": 30, "reward_mean": 0.2},  # .3, pressure .24
            "response_mismatch": {"count": 20, "reward_mean": 0.7},  # reward too high
            "spurious_tool_call": {"count": 7, "reward_mean": 0.0},  # below min count
            "argument_mismatch": {"count": 3, "reward_mean": 0.0},  # below min count
        }
    )
    assert capability_cues(p, CUES) == "\n".join(
        [
            CUES_HEADER,
            f"- {DEFAULT_GUIDELINES['state_mismatch']}",
            f"- {DEFAULT_GUIDELINES['empty_turn_model_response']}",
        ]
    )
    assert CUES_HEADER == "# Behavioral guidelines (env-evolved from recent failures):"


def test_cues_follow_the_profile():
    a = profile({"state_mismatch": {"count": 50, "reward_mean": 0.1}})
    b = profile(
        {
            "missing_tool_call": {"count": 50, "reward_mean": 0.1},
            "recovery_failure": {"count": 10, "reward_mean": 0.0},
        }
    )
    assert select_guidelines(a, CUES) == [DEFAULT_GUIDELINES["state_mismatch"]]
    assert select_guidelines(b, CUES) == [
        DEFAULT_GUIDELINES["missing_tool_call"],
        DEFAULT_GUIDELINES["recovery_failure"],
    ]


def test_cues_prevalence_threshold_and_max_lines():
    tags = {tag: {"count": 10, "reward_mean": 0.0} for tag in DEFAULT_GUIDELINES}  # 9 tags, prevalence 1/9
    assert len(select_guidelines(profile(tags), CUES)) == 3
    assert len(select_guidelines(profile(tags), CapabilityCuesConfig(enable=True, max_lines=5))) == 5
    assert select_guidelines(profile(tags), CapabilityCuesConfig(enable=True, prevalence_threshold=0.2)) == []
    assert select_guidelines(profile(tags), CapabilityCuesConfig(enable=True, max_lines=0)) == []


def test_cues_nothing_qualifies():
    assert capability_cues(None, CUES) == ""
    assert capability_cues({}, CUES) == ""
    assert capability_cues(profile({"pass": {"count": 100, "reward_mean": 1.0}}), CUES) == ""
    assert capability_cues(profile({"unknown_tag": {"count": 100, "reward_mean": 0.0}}), CUES) == ""
    assert capability_cues(profile({"state_mismatch": {"count": 100, "reward_mean": 0.6}}), CUES) == ""
    assert capability_cues(profile({"state_mismatch": {"count": "x", "reward_mean": None}}), CUES) == ""


def test_cues_per_category_and_overrides():
    p = profile(
        {"state_mismatch": {"count": 50, "reward_mean": 0.0}},
        categories={"multi_turn_miss_func": {"spurious_tool_call": {"count": 20, "reward_mean": 0.0}}},
    )
    per_cat = CapabilityCuesConfig(enable=True, per_category=True)
    assert select_guidelines(p, per_cat, "miss_func") == [DEFAULT_GUIDELINES["spurious_tool_call"]]
    assert select_guidelines(p, per_cat, "base") == [DEFAULT_GUIDELINES["state_mismatch"]]  # fallback: global
    assert select_guidelines(p, CUES, "miss_func") == [DEFAULT_GUIDELINES["state_mismatch"]]
    custom = CapabilityCuesConfig(enable=True, guidelines={"state_mismatch": "  Check state.  ", "x": None})
    assert select_guidelines(p, custom) == ["Check state."]
    removed = CapabilityCuesConfig(enable=True, guidelines={"state_mismatch": None})
    assert select_guidelines(p, removed) == []


def test_every_failure_tag_has_a_guideline():
    from env_service.vocabulary import PAPER_LABELS, PROGRESS_TAGS

    failure_tags = set(PROGRESS_TAGS) - {"pass", "correct_abstention", "checker_error", "gt_error"}
    assert failure_tags | set(PAPER_LABELS) == set(DEFAULT_GUIDELINES)
