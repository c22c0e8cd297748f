"""Episode mechanics (as the released environment runs them), the exact texts the model sees, the train-only interface in an
episode, and ground-truth replay through the whole pipeline (all 800 tasks, ~2 s)."""

from __future__ import annotations

import copy
import itertools
import json
import re
import uuid

import pytest
from bfcl_eval.constants import default_prompts as bfcl_prompts  # noqa: E402  (after _bfcl)
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils  # noqa: E402
from bfcl_eval.utils import _func_doc_language_specific_pre_processing  # noqa: E402

from env_service.bfcl import upstream  # sets BFCL_PROJECT_ROOT before any bfcl import below
from env_service.bfcl.calls import parse_call_string
from env_service.bfcl.config import EnvConfig
from env_service.bfcl.episode import Episode, StepResult
from env_service.bfcl.interface import CUES_HEADER, DEFAULT_GUIDELINES, observation_lite
from env_service.bfcl.prompts import OBSERVATION_NOTE, tools_system_prompt
from env_service.bfcl.tasks import all_task_ids, load_task
from env_service.replay import (
    UNSOLVABLE_WITH_ENFORCED_TOOLS,
    calls_message,
    ground_truth_messages,
    replay_ground_truth,
    trace_ground_truth,
)

COMPLETED = "[CONVERSATION_COMPLETED]"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def train(**blocks) -> EnvConfig:
    return EnvConfig.from_dict(blocks)


@pytest.fixture(scope="module")
def base0():
    return load_task("multi_turn_base_0")  # TwitterAPI + GorillaFileSystem, 4 turns


# --- the initial prompt --------------------------------------------------------------------------


def test_qwen_fc_prompt_is_bfcl_qwen_fc_tool_block(base0):
    # bfcl QwenFCHandler._format_prompt's system block (notes §6), written out literally, minus <|im_end|>
    docs = "\n".join(json.dumps(doc) for doc in base0.functions)
    expected = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{docs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    messages = Episode(base0, "validate", EnvConfig()).initial_messages()
    assert messages == [
        {"role": "system", "content": expected},
        {"role": "user", "content": base0.question[0][0]["content"]},
    ]
    assert "Python 3 syntax" not in expected  # no language hint in the system prompt
    assert tools_system_prompt([], "bfcl_qwen_fc") == "" and tools_system_prompt([], "toolace_llama") == ""


def test_toolace_prompt_is_bfcl_default_prompting_prompt(base0):
    # bfcl formulate_system_prompt(DEFAULT_SYSTEM_PROMPT_FORMAT, docs), composed from bfcl's own constants
    assert bfcl_prompts.DEFAULT_SYSTEM_PROMPT_FORMAT == (
        "ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&prompt_fmt=plaintext&style=classic"
    )
    style = bfcl_prompts.PROMPT_STYLE_TEMPLATES["classic"]
    expected = bfcl_prompts.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"],
        task=style["task"],
        tool_call_format=style["tool_call_no_tag"].format(
            output_format=bfcl_prompts.OUTPUT_FORMAT_MAPPING["python"],
            param_types=bfcl_prompts.PARAM_TYPE_MAPPING["python"],
        ),
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=style["available_tools"].format(format="json", functions=json.dumps(base0.functions, indent=4)),
    )
    episode = Episode(base0, "validate", train(tool_prompt_mode="toolace_llama"))
    assert episode.initial_messages()[0]["content"] == expected


def test_observation_lite_in_train_only(base0):
    cfg = train(observation_lite={"enable": True})
    train_system = Episode(base0, "train", cfg).initial_messages()[0]["content"]
    validate_system = Episode(base0, "validate", cfg).initial_messages()[0]["content"]
    assert validate_system == Episode(base0, "validate", EnvConfig()).initial_messages()[0]["content"]
    assert "[required]" not in validate_system and OBSERVATION_NOTE not in validate_system
    assert train_system.endswith("</tool_call>\n\n" + OBSERVATION_NOTE)
    cd_doc = next(json.loads(line) for line in train_system.split("\n") if line.startswith('{"name": "cd"'))
    assert cd_doc["parameters"]["properties"]["folder"]["description"].endswith(" [required]")
    assert base0.functions == load_task("multi_turn_base_0").functions  # task docs untouched


PROFILE = {"step": 5, "tags": {"state_mismatch": {"count": 40, "reward_mean": 0.1}}, "categories": {}}
SWITCHES = {
    "observation_lite": [{"enable": True}, {"enable": True, "add_type_hint": True, "hide_optional": True}],
    "tool_feedback_evolution": [{"enable": True}],
    "capability_cues": [{"enable": True, "min_tag_count": 1}, {"enable": True, "per_category": True}],
}


@pytest.mark.parametrize(
    "blocks",
    [dict(zip(SWITCHES, combo)) for combo in itertools.product(*[[None, *options] for options in SWITCHES.values()])],
)
def test_validate_interface_is_original_whatever_the_switches(base0, blocks):
    cfg = train(**{k: v for k, v in blocks.items() if v is not None})
    original = Episode(base0, "validate", EnvConfig())
    episode = Episode(base0, "validate", cfg, PROFILE)
    assert episode.initial_messages() == original.initial_messages()
    texts = ['<tool_call>{"name": "cd"}</tool_call>', call("cd", folder="nope"), call("cd"), call("nope")]
    for text in texts:
        assert episode.step(text).message == original.step(text).message


# --- texts of turn messages ----------------------------------------------------------------------


def _raw_holdout_docs(task_id: str, turn: int) -> list[dict]:
    """The holdout docs straight from bfcl's data files (independent of env_service.bfcl.tasks)."""
    entry = next(
        json.loads(line)
        for line in open(upstream.PROMPT_PATH / "BFCL_v4_multi_turn_miss_func.json", encoding="utf-8")
        if json.loads(line)["id"] == task_id
    )
    docs = {}
    for class_name in entry["involved_classes"]:
        path = upstream.MULTI_TURN_FUNC_DOC_PATH / upstream.MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
        for line in open(path, encoding="utf-8"):
            doc = json.loads(line)
            docs[doc["name"]] = doc
    return [docs[name] for name in entry["missed_function"][str(turn)]]


def _advance_to(episode: Episode, turn: int) -> StepResult:
    """Answer every turn before ``turn`` with its GT calls, then the plain text that advances."""
    result = None
    for t in range(turn):
        calls = [parse_call_string(c, episode.task) for c in episode.task.ground_truth[t]]
        if calls:
            episode.step(calls_message(calls))
        result = episode.step("ok")
    return result


@pytest.mark.parametrize("task_id", ["multi_turn_miss_func_0", "multi_turn_miss_func_49"])
def test_reveal_message_exact(task_id):
    task = load_task(task_id)
    (turn,) = task.holdout_functions
    # bfcl: DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=json.dumps(docs after one
    # _func_doc_language_specific_pre_processing pass, ensure_ascii=False))
    raw_docs = copy.deepcopy(_raw_holdout_docs(task_id, turn))
    docs = _func_doc_language_specific_pre_processing(raw_docs, "multi_turn_miss_func")
    expected = bfcl_prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(
        functions=json.dumps(docs, ensure_ascii=False)
    )
    assert expected.count(" Note that the provided function is in Python 3 syntax.") == len(docs)
    cfg = train(observation_lite={"enable": True})  # revealed docs never carry observation hints
    for _ in range(2):  # a second episode sees the same text (no suffix accumulates on shared data)
        episode = Episode(task, "train", cfg)
        system = episode.initial_messages()[0]["content"]
        result = _advance_to(episode, turn)
        assert result.message == {"role": "user", "content": expected}
        assert result.info["advanced"] and result.info["revealed_tools"] == [d["name"] for d in docs]
        assert episode.initial_messages()[0]["content"] == system  # system prompt never updated
        assert all(f'"name": "{d["name"]}"' not in system for d in docs)
    assert task.holdout_functions == load_task(task_id).holdout_functions


def test_holdout_tool_unavailable_until_revealed():
    task = load_task("multi_turn_miss_func_0")  # sort held out until turn 3
    episode = Episode(task, "validate", EnvConfig())
    rejected = episode.step(call("sort", file_name="final_report.pdf"))
    assert rejected.message == {
        "role": "user",
        "content": "[ERROR] Invalid tool call format: Tool 'sort' is not available in the current tool list.",
    }
    assert rejected.info["error_type"] == "unavailable_tool" and not rejected.info["advanced"]
    assert episode.turn_records[0].rejected_calls[0].name == "sort"
    episode = Episode(task, "validate", EnvConfig())
    _advance_to(episode, 3)
    assert "sort" in episode.tool_names
    accepted = episode.step(call("sort", file_name="final_report.pdf"))
    assert accepted.message["content"].startswith("<tool_response>\n") and accepted.info["num_calls"] == 1


def test_rejected_message_executes_nothing(base0):
    episode = Episode(base0, "validate")
    # one valid call plus one unavailable call: the whole message is rejected, mkdir does not run
    result = episode.step(call("mkdir", dir_name="new") + call("unknown_tool"))
    assert result.message["content"] == (
        "[ERROR] Invalid tool call format: Tool 'unknown_tool' is not available in the current tool list."
    )
    listing = episode.step(call("ls"))
    assert "new" not in listing.message["content"]


def test_parse_errors_joined_and_no_turn_advance(base0):
    episode = Episode(base0, "validate")
    text = '<tool_call>{"name": "ls"}</tool_call>\n<tool_call>{"name": "cd", "arguments": [1]}</tool_call>'
    result = episode.step(text)
    assert result.message["content"] == (
        "[ERROR] Invalid tool call format: Tool call JSON must contain both 'name' and 'arguments'.; "
        "Tool 'cd' arguments must be a JSON object."
    )
    assert result.info["error_type"] == "parse_error" and result.info["turn"] == 0 and not result.terminated
    assert episode.turn_records[0].parse_errors == [
        "Tool call JSON must contain both 'name' and 'arguments'.",
        "Tool 'cd' arguments must be a JSON object.",
    ]
    tag_only = episode.step("<tool_call> oops")
    assert tag_only.message["content"] == (
        "[ERROR] Invalid tool call format: Found tool_call tag text, but no valid <tool_call>{...}</tool_call> block."
    )
    assert episode.turn == 0


def test_lenient_parser_executes_the_valid_calls(base0):
    episode = Episode(base0, "validate", train(strict_tool_parser=False))
    result = episode.step("<tool_call>{bad json}</tool_call>" + call("pwd"))
    pwd = '{"current_working_directory": "/workspace"}'
    assert result.message["content"] == f"<tool_response>\n{pwd}\n</tool_response>\n"
    missing = episode.step('<tool_call>{"name": "", "arguments": {}}</tool_call>')
    assert missing.message["content"] == ("[ERROR] Invalid tool call format: Missing function name in tool call.")
    bad_args = episode.step('<tool_call>{"name": "cd", "arguments": "nope"}</tool_call>')
    assert bad_args.message["content"] == (
        "[ERROR] Invalid tool call format: Tool 'cd' has invalid JSON arguments: nope"
    )


def test_turn_advance_and_completion(base0):
    episode = Episode(base0, "validate")
    assert episode.step(call("pwd")).info["advanced"] is False
    for t in range(1, len(base0.question)):
        result = episode.step("Done.")
        assert result.message == {"role": "user", "content": base0.question[t][0]["content"]}
        assert result.info["advanced"] and result.info["turn"] == t and not result.terminated
    final = episode.step("All done.")
    assert final.message == {"role": "user", "content": COMPLETED} and final.terminated
    assert episode.terminated
    with pytest.raises(ValueError, match="already terminated"):
        episode.step("more")
    evaluation = episode.evaluate()
    assert evaluation["num_turns"] == len(base0.question)
    assert evaluation["num_steps"] == len(base0.question) + 1
    assert evaluation["valid"] is False and evaluation["reward"] == 0.0


def test_tool_results_equal_bfcl_execution(base0):
    """Replies are bfcl's result strings in <tool_response> blocks (oracle: bfcl's eval-based executor)."""
    sequence = [
        [("cd", {"folder": "document"}), ("ls", {"a": True})],
        [("cd", {"folder": "missing"})],
        [("cd", {})],
        [("post_tweet", {"content": "hi"})],
        [("mkdir", {"dir_name": "temp"}), ("mv", {"source": "final_report.pdf", "destination": "temp"})],
        [("authenticate_twitter", {"username": "john", "password": "x"})],
    ]
    episode = Episode(base0, "validate")
    name = f"seal_test_{uuid.uuid4().hex[:8]}"
    try:
        for calls in sequence:
            strings = [f"{n}({','.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls]
            expected, _ = multi_turn_utils.execute_multi_turn_func_call(
                strings, base0.initial_config, base0.involved_classes, name, base0.id
            )
            reply = episode.step("".join(call(n, **a) for n, a in calls))
            blocks = "".join(f"<tool_response>\n{r}\n</tool_response>\n" for r in expected)
            assert reply.message["content"] == blocks
            assert reply.info["num_calls"] == len(calls)
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith(name)]:
            del vars(multi_turn_utils)[key]


def test_tool_error_info(base0):
    episode = Episode(base0, "validate")
    assert episode.step(call("cd", folder="missing")).info["error_type"] == "tool_error"
    assert episode.step(call("pwd")).info["error_type"] is None


def test_ipython_result_mode(base0):
    episode = Episode(base0, "validate", train(tool_result_mode="ipython"))
    result = episode.step(call("pwd") + call("pwd"))
    # one ipython message per result, as bfcl's Llama handler appends execution results
    one = {"role": "ipython", "content": '{"current_working_directory": "/workspace"}'}
    assert result.message == one and result.extra_messages == [one]
    assert episode.step("next").message["role"] == "user"


def test_toolace_mode_episode(base0):
    episode = Episode(base0, "validate", train(tool_prompt_mode="toolace_llama"))
    result = episode.step("[cd(folder='document'), ls()]")
    assert result.info["num_calls"] == 2 and result.message["content"].count("<tool_response>") == 2
    rejected = episode.step("[cd('document')]")
    assert rejected.message["content"] == (
        "[ERROR] Invalid tool call format: Tool 'cd' uses positional arguments; pass every argument as name=value."
    )


def test_episodes_are_independent(base0):
    first, second = Episode(base0, "validate"), Episode(base0, "validate")
    first.step(call("mkdir", dir_name="only_in_first"))
    assert "only_in_first" in first.step(call("ls")).message["content"]
    assert "only_in_first" not in second.step(call("ls")).message["content"]


@pytest.mark.parametrize("mode", ["bogus", "val", "validation", "test", "sample"])
def test_only_train_and_validate_modes_exist(base0, mode):
    with pytest.raises(ValueError, match="unknown episode mode"):
        Episode(base0, mode)


@pytest.mark.parametrize("enforce, strict", list(itertools.product([True, False], repeat=2)))
@pytest.mark.parametrize("name, kind", [('["x"]', "list"), ('{"a": 1}', "dict")])
def test_list_or_object_tool_names_read_as_released(base0, enforce, strict, name, kind):
    # The released environment looks the name up in a set; a list or an object raises there, and the message
    # is what the model reads. Nothing runs, also not the valid call before it.
    config = train(enforce_available_tools=enforce, strict_tool_parser=strict)
    episode = Episode(base0, "validate", config)
    bad = f'<tool_call>{{"name": {name}, "arguments": {{}}}}</tool_call>'
    result = episode.step(call("mkdir", dir_name="new") + bad)
    assert result.message["content"] == f"[ERROR] Invalid tool call format: unhashable type: '{kind}'"
    assert result.info["num_calls"] == 0 and result.info["num_rejected_calls"] == 2
    assert "new" not in episode.step(call("ls")).message["content"]


@pytest.mark.parametrize(
    "name, text",
    [
        ("[]", "Missing function name in tool call."),
        ("null", "Missing function name in tool call."),
        ("5", "Tool '5' is not available in the current tool list."),
    ],
)
def test_empty_null_and_number_tool_names_read_as_released(base0, name, text):
    episode = Episode(base0, "validate")
    reply = episode.step(f'<tool_call>{{"name": {name}, "arguments": {{}}}}</tool_call>').message["content"]
    assert reply == f"[ERROR] Invalid tool call format: {text}"


# --- recovery feedback on real BFCL errors -------------------------------------------------------


def _feedback_replies(task, mode: str, texts: list[str]) -> list[str]:
    episode = Episode(task, mode, train(tool_feedback_evolution={"enable": True}))
    return [episode.step(text).message["content"] for text in texts]


def test_tradingbot_error_list_is_a_tool_error_without_a_hint():
    # One rule (the verifier's) says whether a result is an error; the text stays the released one: no hint.
    episode = Episode(load_task("multi_turn_base_100"), "train", train(tool_feedback_evolution={"enable": True}))
    episode.step(call("trading_logout"))
    result = episode.step(call("get_watchlist"))
    error = "['Error: User not authenticated. Please log in to view the watchlist.']"
    assert result.message["content"] == f"<tool_response>\n{error}\n</tool_response>\n"
    assert result.info["error_type"] == "tool_error" and result.info["num_tool_errors"] == 1


def test_feedback_hints_on_real_bfcl_errors(base0):
    texts = [
        call("cd", folder="missing"),
        call("cd"),
        call("cd", folder="document", depth=2),
        call("post_tweet", content="x"),
    ]
    hinted = _feedback_replies(base0, "train", texts)
    plain = _feedback_replies(base0, "validate", texts)
    hints = [reply[len(original) :] for reply, original in zip(hinted, plain)]
    assert all(reply.startswith(original) for reply, original in zip(hinted, plain))
    error = '{"error": "cd: \'missing\': No such file or directory"}'
    assert plain[0] == f"<tool_response>\n{error}\n</tool_response>\n"
    assert hints[0].startswith("[ToolHint] The path given to `cd` does not exist in the current state.")
    # bfcl's exception text (upstream's detector misses "Error during execution: ...")
    assert plain[1] == (
        "<tool_response>\nError during execution: "
        "GorillaFileSystem.cd() missing 1 required positional argument: 'folder'\n</tool_response>\n"
    )
    assert hints[1] == (
        "[ToolHint] Required argument(s) 'folder' for `cd` were missing. "
        "Re-emit the tool_call with these keys present in `arguments`.\n"
    )
    assert hints[2] == (
        "[ToolHint] `cd` does not accept argument `depth`. Drop it and only use arguments listed in the tool schema.\n"
    )
    assert hints[3].startswith("[ToolHint] This call needs an authenticated session.")
    assert all(h.endswith("\n") and h.count("[ToolHint]") == 1 for h in hints)


def test_feedback_on_parse_errors_and_success(base0):
    hinted = _feedback_replies(base0, "train", ["<tool_call>{bad}</tool_call>", call("pwd"), call("nope")])
    lines = hinted[0].split("\n")
    assert lines[0].startswith("[ERROR] Invalid tool call format: Invalid tool call JSON: ")
    assert lines[1].startswith("[Hint] Each tool call MUST be a JSON object")
    assert lines[2].startswith("[Hint] Available tools: authenticate_twitter, comment,")
    assert lines[2].endswith(", ... (+20 more).")
    assert "[ToolHint]" not in hinted[1]  # no error, no hint
    assert hinted[2].split("\n")[1].startswith("[Hint] Available tools:")  # unavailable tool: no format line


# --- capability cues -----------------------------------------------------------------------------


def _system(task, mode, profile, **cues):
    cfg = train(capability_cues={"enable": True, **cues}, observation_lite={"enable": True})
    return Episode(task, mode, cfg, profile).initial_messages()[0]["content"]


def test_capability_cues_follow_the_pushed_profile(base0):
    state = _system(base0, "train", PROFILE)
    tool_prompt = tools_system_prompt(observation_lite(base0.functions, EnvConfig().observation_lite))
    assert state == (f"{tool_prompt}\n\n{OBSERVATION_NOTE}\n\n{CUES_HEADER}\n- {DEFAULT_GUIDELINES['state_mismatch']}")
    other = {"step": 6, "tags": {"spurious_tool_call": {"count": 30, "reward_mean": 0.0}}}
    expected_block = f"{CUES_HEADER}\n- {DEFAULT_GUIDELINES['spurious_tool_call']}"
    assert _system(base0, "train", other).endswith(expected_block)
    below = {"step": 7, "tags": {"state_mismatch": {"count": 3, "reward_mean": 0.0}}}
    assert CUES_HEADER not in _system(base0, "train", below)
    assert _system(base0, "train", below).endswith(OBSERVATION_NOTE)
    assert CUES_HEADER not in _system(base0, "train", None)
    assert CUES_HEADER not in _system(base0, "validate", PROFILE)
    assert CUES_HEADER in _system(base0, "validate", PROFILE, apply_to_validation=True)


def test_episode_info(base0):
    cfg = train(observation_lite={"enable": True}, capability_cues={"enable": True})
    info = Episode(base0, "train", cfg, PROFILE).info
    assert info["observation_lite"] and info["capability_cues"] and info["capability_cue_lines"] == 1
    assert info["questions_count"] == len(base0.question)


# --- ground-truth replay through the whole pipeline ----------------------------------------------


def test_ground_truth_messages_shape():
    task = load_task("multi_turn_miss_func_0")
    messages = ground_truth_messages(task)
    assert len(messages) == sum(1 for turn in task.ground_truth if turn) + len(task.ground_truth)
    # positional GT arguments are bound to names: sort('final_report.pdf') -> file_name
    sort = '{"name": "sort", "arguments": {"file_name": "final_report.pdf"}}'
    assert f"<tool_call>\n{sort}\n</tool_call>" in messages
    assert ground_truth_messages(task, "toolace_llama")[-2].startswith("[cd(folder='..'), mv(")


def test_replay_all_800_tasks_and_the_unsolvable_list():
    """Every task passes a GT replay except those unsolvable under enforce_available_tools (with reasons)."""
    failing = {}
    for task_id in all_task_ids():
        trace = trace_ground_truth(load_task(task_id))
        assert trace.terminated and trace.replies[-1]["content"] == COMPLETED, task_id
        if not trace.evaluation.valid or trace.rejections:
            failing[task_id] = trace
        else:
            assert trace.evaluation.progress == 1.0
            assert set(trace.evaluation.tags) <= {"pass", "correct_abstention"}
    assert sorted(failing) == sorted(UNSOLVABLE_WITH_ENFORCED_TOOLS)
    trace = failing["multi_turn_miss_func_49"]
    # GT turn 1 calls tail, held out until turn 3: the call is rejected, so the turn cannot pass
    assert trace.rejections == [
        "[ERROR] Invalid tool call format: Tool 'tail' is not available in the current tool list."
    ]
    task = load_task("multi_turn_miss_func_49")
    assert any(c.startswith("tail(") for c in task.ground_truth[1])
    assert "tail" in [d["name"] for d in task.holdout_functions[3]]
    assert trace.evaluation.error_turn == 1
    assert re.search(r"\btail\b", UNSOLVABLE_WITH_ENFORCED_TOOLS["multi_turn_miss_func_49"])


def test_unsolvable_tasks_pass_without_enforcement():
    for task_id in UNSOLVABLE_WITH_ENFORCED_TOOLS:
        assert replay_ground_truth(load_task(task_id), train(enforce_available_tools=False)).valid


@pytest.mark.parametrize("category", ["base", "miss_func", "miss_param", "long_context"])
def test_replay_toolace_and_train_interface(category):
    cfg_toolace = train(tool_prompt_mode="toolace_llama")
    cfg_train = train(
        observation_lite={"enable": True},
        tool_feedback_evolution={"enable": True},
        capability_cues={"enable": True},
    )
    for task_id in all_task_ids(category)[:50]:
        if task_id in UNSOLVABLE_WITH_ENFORCED_TOOLS:
            continue
        task = load_task(task_id)
        assert replay_ground_truth(task, cfg_toolace).valid, task_id
        assert replay_ground_truth(task, cfg_train, mode="train").valid, task_id


def test_evaluate_uses_the_config_reward_block():
    task = load_task("multi_turn_base_1")
    episode = Episode(task, "validate", train(reward={"mode": "capped", "partial_credit_cap": 0.5}))
    for text in ground_truth_messages(task)[:2]:  # turn 0 only, then advance
        episode.step(text)
    evaluation = episode.evaluate()
    # ended early (force-terminated): 1 of 4 GT turns passed -> capped partial credit min(0.5, 0.25)
    assert evaluation["valid"] is False and evaluation["progress"] == 0.25 and evaluation["reward"] == 0.25
    assert evaluation["num_turns"] == 2 and evaluation["num_steps"] == 2
    from env_service.bfcl.config import RewardConfig

    assert episode.evaluate(RewardConfig())["reward"] == 0.0  # an explicit reward config wins


def test_reading_a_message_counts_against_its_time_budget():
    """A message whose calls take longer to read than the message's budget is refused unread (nothing runs, the turn
    records a parse error) and the episode goes on; with the usual budget the same message is read and refused for
    its call count."""
    from env_service.bfcl.config import ServiceLimits

    slow_to_read = "[" + ", ".join(["ls(a=[" + ",".join(["1"] * 500) + "])"] * 250) + "]"  # ~0.5 s of reading
    config = EnvConfig.from_dict({"tool_prompt_mode": "toolace_llama"})
    tight = Episode(load_task("multi_turn_base_0"), "validate", config, limits=ServiceLimits(message_budget_s=0.01))
    reply = tight.step(slow_to_read)
    assert "could not be read within its time budget of 0.01 s" in reply.message["content"]
    assert reply.info["error_type"] == "parse_error" and not reply.terminated
    assert tight.step("[ls()]").info["num_calls"] == 1  # the episode goes on
    assert any("time budget" in error for error in tight.turn_records[0].parse_errors)  # the verifier sees it
    usual = Episode(load_task("multi_turn_base_0"), "validate", config)
    assert "250 tool calls in one message" in usual.step(slow_to_read).message["content"]
