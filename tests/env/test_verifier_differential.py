"""Verifier vs bfcl-eval's multi_turn_checker (reference oracle), tags, labels and rewards."""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
import re
from collections import Counter

import pytest
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils as mtu
from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context as lc_module
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

from env_service.bfcl import upstream  # noqa: F401  (sets BFCL_PROJECT_ROOT before bfcl_eval is imported)
from env_service.bfcl.calls import ToolCall, format_call_string, parse_call_string
from env_service.bfcl.config import RewardConfig
from env_service.bfcl.tasks import CATEGORIES, all_task_ids, load_task
from env_service.bfcl.verifier import (
    Evaluation,
    TurnRecord,
    evaluate_calls,
    evaluate_episode,
    reward_from,
    score_record,
)
from env_service.vocabulary import LABELS, PROGRESS_TAGS

SEED = 20240611
KINDS = (
    "drop_call",
    "reorder_calls",
    "extra_call",
    "wrong_value",
    "wrong_type",
    "unknown_tool",
    "emptied_turn",
    "truncated",
)
_names = itertools.count()


# -- the reference ----------------------------------------------------------------------------------


def _cleanup(model_name: str) -> None:
    prefix = re.sub(r"[-./:]", "_", model_name)  # covers <name>_eval_* and <name>_ground_truth_eval_*
    for key in [k for k in vars(mtu) if k.startswith(prefix)]:
        del vars(mtu)[key]


def bfcl_verdict(task, model_turns: list[list[ToolCall]]) -> tuple[bool, str | None]:
    """bfcl's verdict for our calls: the turn-count rule of _evaluate_single_multi_turn_entry, then
    multi_turn_checker on the call strings format_call_string produces, one call per step."""
    if len(model_turns) != len(task.ground_truth):
        return False, "multi_turn:force_terminated"
    decoded = [[[format_call_string(call)] for call in turn] for turn in model_turns]
    entry = {
        "id": task.id,
        "initial_config": copy.deepcopy(task.initial_config),
        "involved_classes": list(task.involved_classes),
    }
    model_name = f"seal_test_verifier_{os.getpid()}_{next(_names)}"
    try:
        result = multi_turn_checker(decoded, task.ground_truth, entry, task.data_source, model_name)
    finally:
        _cleanup(model_name)
    return result["valid"], result.get("error_type")


@pytest.fixture(scope="module", autouse=True)
def restore_bfcl_module_state():
    # bfcl's long-context TravelAPI mutates module dicts in place; keep other tests unaffected.
    saved = {k: copy.deepcopy(v) for k, v in vars(lc_module).items() if isinstance(v, dict) and not k.startswith("_")}
    yield
    for name, value in saved.items():
        vars(lc_module)[name].clear()
        vars(lc_module)[name].update(value)
    assert not [k for k in vars(mtu) if k.startswith("seal_test_verifier_")]


def gt_turns(task) -> list[list[ToolCall]]:
    return [[parse_call_string(s, task) for s in turn] for turn in task.ground_truth]


# -- perturbations ----------------------------------------------------------------------------------

_FOREIGN_TOOLS = ("authenticate_travel", "get_stock_info", "startEngine", "send_message", "cd", "mean")


def _mutate_value(value, rng: random.Random):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([1, -1, 7])
    if isinstance(value, float):
        return value + rng.choice([1.5, -0.25, 100.0])
    if isinstance(value, str):
        return rng.choice([value + "_x", "", value.upper() if value != value.upper() else value + "Z"])
    if isinstance(value, list):
        return value[:-1] if value else ["x"]
    if isinstance(value, dict):
        return {}
    return "x"


def _retype_value(value, rng: random.Random):
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return int(value) if value.isdigit() else [value]
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return 0


def perturb(task, kind: str, rng: random.Random) -> list[list[ToolCall]] | None:
    turns = gt_turns(task)
    spots = [(t, i) for t, turn in enumerate(turns) for i in range(len(turn))]
    with_args = [(t, i) for t, i in spots if turns[t][i].arguments]
    if kind == "drop_call" and spots:
        t, i = rng.choice(spots)
        del turns[t][i]
    elif kind == "reorder_calls":
        candidates = [t for t, turn in enumerate(turns) if len({format_call_string(c) for c in turn}) > 1]
        if not candidates:
            return None
        t = rng.choice(candidates)
        original = [format_call_string(c) for c in turns[t]]
        while [format_call_string(c) for c in turns[t]] == original:
            rng.shuffle(turns[t])
    elif kind == "extra_call" and spots:
        t, i = rng.choice(spots)
        target = rng.randrange(len(turns))
        turns[target].insert(rng.randint(0, len(turns[target])), copy.deepcopy(turns[t][i]))
    elif kind in ("wrong_value", "wrong_type") and with_args:
        t, i = rng.choice(with_args)
        call = turns[t][i]
        key = rng.choice(sorted(call.arguments))
        change = _mutate_value if kind == "wrong_value" else _retype_value
        call.arguments[key] = change(call.arguments[key], rng)
    elif kind == "unknown_tool" and spots:
        t, i = rng.choice(spots)
        call = turns[t][i]
        call.name = rng.choice(["nonexistent_tool", call.name + "_v2", rng.choice(_FOREIGN_TOOLS)])
    elif kind == "emptied_turn":
        candidates = [t for t, turn in enumerate(turns) if turn]
        turns[rng.choice(candidates)] = []
    elif kind == "truncated":
        turns = turns[: rng.randrange(len(turns))]
    else:
        return None
    return turns


def _perturbation_cases():
    cases = []
    for n, task_id in enumerate(all_task_ids()):
        rng = random.Random(SEED + n)
        for offset in range(len(KINDS)):  # first applicable kind, starting round-robin
            kind = KINDS[(n + offset) % len(KINDS)]
            task = load_task(task_id)
            turns = perturb(task, kind, rng)
            if turns is not None:
                cases.append((task, kind, turns))
                break
    return cases


# -- differential -----------------------------------------------------------------------------------


def test_ground_truth_replay_800_of_800():
    for task_id in all_task_ids():
        task = load_task(task_id)
        turns = gt_turns(task)
        assert bfcl_verdict(task, turns) == (True, None), task_id
        evaluation = evaluate_calls(task, turns)
        assert evaluation.valid and evaluation.error_type is None, task_id
        assert set(evaluation.tags) <= {"pass", "correct_abstention"}, (task_id, evaluation.tags)
        assert set(evaluation.labels) == {"pass"}
        assert len(evaluation.tags) == len(task.ground_truth)
        assert evaluation.progress == 1.0 and evaluation.progress_with_irrelevance == 1.0
        assert evaluation.reward == 1.0


def test_perturbations_match_bfcl_verdicts():
    cases = _perturbation_cases()
    assert len(cases) >= 500
    coverage = Counter((task.category, kind) for task, kind, _ in cases)
    assert {category for category, _ in coverage} == set(CATEGORIES)
    assert all(coverage[(c, k)] >= 5 for c in CATEGORIES for k in KINDS), coverage
    outcomes = Counter()
    for task, kind, turns in cases:
        expected_valid, expected_error = bfcl_verdict(task, turns)
        evaluation = evaluate_calls(task, turns)
        assert (evaluation.valid, evaluation.error_type) == (expected_valid, expected_error), (task.id, kind, turns)
        outcomes[(kind, expected_valid)] += 1
        _check_tag_consistency(task, turns, evaluation)
    # the perturbations are not trivial: every kind except truncation produces both verdicts somewhere
    assert sum(n for (_, valid), n in outcomes.items() if not valid) > 400
    assert sum(n for (_, valid), n in outcomes.items() if valid) > 10


def _check_tag_consistency(task, turns, evaluation: Evaluation) -> None:
    assert len(evaluation.tags) == len(evaluation.labels) == len(task.ground_truth)
    assert set(evaluation.tags) <= set(PROGRESS_TAGS) and set(evaluation.labels) <= set(LABELS)
    scorable = [tag for tag, gt in zip(evaluation.tags, task.ground_truth) if gt]
    all_scorable_pass = all(tag == "pass" for tag in scorable)
    # tags come from the same fresh replay as the verdict, so they agree with it
    assert evaluation.valid == (len(turns) == len(task.ground_truth) and all_scorable_pass)
    for tag, label in zip(evaluation.tags, evaluation.labels):
        assert (label == "pass") == (tag in ("pass", "correct_abstention"))
    assert evaluation.terminated_early == (len(turns) < len(task.ground_truth))


# -- tags and labels on handcrafted cases -------------------------------------------------------------


def _base0_with(turn_index: int, call_strings: list[str], **record_fields) -> list[TurnRecord]:
    task = load_task("multi_turn_base_0")
    records = [TurnRecord(calls=turn) for turn in gt_turns(task)]
    records[turn_index] = TurnRecord(calls=[parse_call_string(s, task) for s in call_strings], **record_fields)
    return records


@pytest.mark.parametrize(
    "turn, calls, fields, tag, label",
    [
        # grep with a wrong required value: right tool, wrong argument
        (
            1,
            ["cd(folder='temp')", "grep(file_name='final_report.pdf',pattern='xyz')"],
            {},
            "response_mismatch",
            "argument_mismatch",
        ),
        # an unexpected keyword argument (TypeError) on a GT function
        (
            1,
            ["cd(folder='temp')", "grep(file_name='final_report.pdf',pattern='budget analysis',flags='-i')"],
            {},
            "response_mismatch",
            "argument_mismatch",
        ),
        # an extra state-changing call: interaction otherwise right
        (
            0,
            [
                "cd(folder='document')",
                "mkdir(dir_name='temp')",
                "mkdir(dir_name='extra')",
                "mv(source='final_report.pdf', destination='temp')",
            ],
            {},
            "state_mismatch",
            "state_mismatch",
        ),
        # a tool that does not exist
        (
            1,
            ["cd(folder='temp')", "search_text(file_name='final_report.pdf')"],
            {},
            "response_mismatch",
            "invalid_tool_call",
        ),
        # the parser rejected the model's only attempt
        (
            1,
            [],
            {"parse_errors": ["Invalid tool call JSON: Expecting value: line 1 column 1 (char 0)"]},
            "empty_turn_model_response",
            "invalid_tool_call",
        ),
        # a call rejected as unavailable
        (1, [], {"rejected_calls": [ToolCall("grep", {})]}, "empty_turn_model_response", "invalid_tool_call"),
        # an execution error, then the turn still fails (grep never called)
        (1, ["cd(folder='temp')", "cat(file_name='missing.txt')"], {}, "response_mismatch", "recovery_failure"),
        # skipped a needed call
        (1, ["cd(folder='temp')"], {}, "response_mismatch", "missing_tool_call"),
        # answered without calling anything
        (1, [], {}, "empty_turn_model_response", "missing_tool_call"),
    ],
)
def test_labels_for_handcrafted_turns(turn, calls, fields, tag, label):
    task = load_task("multi_turn_base_0")
    evaluation = evaluate_episode(task, _base0_with(turn, calls, **fields))
    assert evaluation.tags[turn] == tag
    assert evaluation.labels[turn] == label
    assert not evaluation.valid
    assert evaluation.labels[:turn] == ["pass"] * turn


def test_response_mismatch_label_when_interaction_looks_fine():
    task = load_task("multi_turn_base_15")  # turn 2: tail(file_name='DataSet1.csv', lines=1)
    turns = gt_turns(task)
    assert [format_call_string(c) for c in turns[2]] == ["tail(file_name='DataSet1.csv',lines=1)"]
    turns[2] = [ToolCall("tail", {"file_name": "DataSet1.csv"})]  # optional `lines` left at its default
    evaluation = evaluate_calls(task, turns)
    assert (evaluation.tags[2], evaluation.labels[2]) == ("response_mismatch", "response_mismatch")
    assert evaluation.error_type == "multi_turn:execution_response_mismatch" and evaluation.error_turn == 2


def test_abstention_turns():
    task = load_task("multi_turn_miss_param_0")  # turn 3 has empty GT (a parameter is missing)
    turns = gt_turns(task)
    evaluation = evaluate_calls(task, turns)
    assert evaluation.tags[3] == "correct_abstention" and evaluation.irrelevance_turns == 1
    turns[3] = [parse_call_string("cd(folder='..')", task)]
    evaluation = evaluate_calls(task, turns)
    assert (evaluation.tags[3], evaluation.labels[3]) == ("spurious_tool_call", "missing_tool_call")
    assert evaluation.passed_irrelevance_turns == 0
    # bfcl does not apply its irrelevance checker: the verdict depends only on later state/responses
    assert evaluation.valid == bfcl_verdict(task, turns)[0]


def test_truncated_episode_pads_turns():
    task = load_task("multi_turn_base_0")
    evaluation = evaluate_calls(task, gt_turns(task)[:2])
    assert evaluation.tags == ["pass", "pass", "empty_turn_model_response", "empty_turn_model_response"]
    assert evaluation.labels == ["pass", "pass", "missing_tool_call", "missing_tool_call"]
    assert evaluation.terminated_early and not evaluation.valid
    assert evaluation.error_type == "multi_turn:force_terminated"
    assert (evaluation.progress, evaluation.num_model_turns, evaluation.num_gt_turns) == (0.5, 2, 4)
    assert json.loads(json.dumps(evaluation.to_dict())) == evaluation.to_dict()


def test_exec_errors_are_counted():
    evaluation = evaluate_episode(
        load_task("multi_turn_base_0"), _base0_with(1, ["cd(folder='temp')", "cat(file_name='missing.txt')", "nope()"])
    )
    assert evaluation.exec_errors == 2


# -- rewards -----------------------------------------------------------------------------------------


def _evaluation(valid=False, passed=2, scorable=4, irrelevance=0, passed_irrelevance=0) -> Evaluation:
    denominator = scorable + irrelevance
    return Evaluation(
        task_id="multi_turn_base_0",
        category="base",
        valid=valid,
        reward=0.0,
        error_type=None,
        error_turn=None,
        tags=[],
        labels=[],
        progress=passed / scorable if scorable else 0.0,
        progress_with_irrelevance=(passed + passed_irrelevance) / denominator if denominator else 0.0,
        passed_turns=passed,
        scorable_turns=scorable,
        irrelevance_turns=irrelevance,
        passed_irrelevance_turns=passed_irrelevance,
        terminated_early=False,
        num_model_turns=4,
        num_gt_turns=4,
        exec_errors=0,
    )


@pytest.mark.parametrize(
    "config, expected",
    [
        (RewardConfig(), 0.0),  # binary
        (RewardConfig(mode="capped"), 0.5),  # min(0.7, 1.0 * 0.5)
        (RewardConfig(mode="capped", partial_credit_cap=0.3), 0.3),
        (RewardConfig(mode="capped", partial_credit_cap=0.0), 0.0),  # the SEAL recipe: binary in effect
        (RewardConfig(mode="capped", partial_credit_weight=0.5), 0.25),
        (RewardConfig(mode="capped", partial_credit_weight=-1.0), 0.0),
        (RewardConfig(mode="capped", partial_credit_cap=1.5, partial_credit_weight=3.0), 1.0),  # clamped
        (RewardConfig(mode="t3rl"), 0.5),  # 2 / 4
    ],
)
def test_reward_formulas(config, expected):
    assert reward_from(_evaluation(), config) == pytest.approx(expected)
    assert reward_from(_evaluation(valid=True), config) == 1.0


def test_t3rl_reward_with_irrelevance_turns():
    evaluation = _evaluation(passed=3, scorable=4, irrelevance=2, passed_irrelevance=1)
    assert reward_from(evaluation, RewardConfig(mode="t3rl")) == pytest.approx((3 + 0.5 * 1) / (4 + 0.5 * 2))
    assert reward_from(evaluation, RewardConfig(mode="t3rl", irrelevance_weight=1.0)) == pytest.approx(4 / 6)
    none_passed = _evaluation(passed=0, scorable=4, irrelevance=2, passed_irrelevance=2)
    assert reward_from(none_passed, RewardConfig(mode="t3rl", scorable_floor=True)) == 0.0
    assert reward_from(none_passed, RewardConfig(mode="t3rl")) == pytest.approx(0.5 * 2 / 5)
    only_irrelevance = _evaluation(passed=0, scorable=0, irrelevance=1, passed_irrelevance=1)
    assert reward_from(only_irrelevance, RewardConfig(mode="t3rl", irrelevance_weight=0.0)) == 1.0  # fallback


def test_reward_on_a_real_episode():
    task = load_task("multi_turn_miss_param_0")  # 5 turns, turn 3 abstention
    turns = gt_turns(task)[:4]  # stops before the last turn
    capped = evaluate_calls(task, turns, RewardConfig(mode="capped"))
    assert capped.progress == pytest.approx(3 / 4) and capped.reward == pytest.approx(0.7)
    t3rl = evaluate_calls(task, turns, RewardConfig(mode="t3rl"))
    assert t3rl.reward == pytest.approx((3 + 0.5) / (4 + 0.5))
    assert evaluate_calls(task, turns).reward == 0.0


def test_reward_config_validation():
    with pytest.raises(ValueError, match="reward mode"):
        RewardConfig(mode="dense")
    with pytest.raises(ValueError):
        RewardConfig(mode="capped", partial_credit_cap=float("nan"))


# -- score_record (CLI input) --------------------------------------------------------------------------


def test_score_record():
    task = load_task("multi_turn_base_0")
    record = {"id": task.id, "turns": [[c.to_dict() for c in turn] for turn in gt_turns(task)]}
    assert score_record(record) == {
        "id": task.id,
        "valid": True,
        "tags": ["pass"] * 4,
        "labels": ["pass"] * 4,
        "progress": 1.0,
    }
    record["turns"] = record["turns"][:1]
    assert score_record(record)["valid"] is False


@pytest.mark.parametrize(
    "record",
    [
        [],
        {"turns": []},
        {"id": "multi_turn_base_0"},
        {"id": "multi_turn_nope_1", "turns": []},
        {"id": "multi_turn_base_0", "turns": {}},
        {"id": "multi_turn_base_0", "turns": [{"name": "ls"}]},
        {"id": "multi_turn_base_0", "turns": [[{"arguments": {}}]]},
        {"id": "multi_turn_base_0", "turns": [[{"name": "ls", "arguments": "{}"}]]},
    ],
)
def test_score_record_rejects_malformed(record):
    with pytest.raises(ValueError):
        score_record(record)
