"""bfcl-eval's own evaluation scores our results files exactly as we do.

Real episodes on the environment service (in process), a scripted model that replays each task's ground truth
(or a damaged version of it), our results records, bfcl's result-file layout, and bfcl's own runner and checker
in a subprocess: the per-category accuracy and the set of failing tasks must agree.
"""

from __future__ import annotations

import json

import pytest

from env_service.bfcl.calls import parse_call_string
from env_service.bfcl.tasks import load_task
from env_service.client import make_client
from env_service.control_text import ControlText
from seal.eval.bfcl_files import render_step, score_file, score_with_bfcl
from seal.eval.endpoint import run_episode
from seal.results import tables
from seal.results.records import append_record, load_records

#: These episodes replay scripted answers: nothing to escape (the escape: tests/env/test_env_text_is_data.py).
NO_MARKUP = ControlText(())

# Passing and failing tasks in every category; multi_turn_miss_func_49's ground truth calls a tool before it is
# revealed, which our environment refuses: bfcl must fail it too (it only sees the calls that ran).
TASKS = {
    "multi_turn_base_0": "gt",
    "multi_turn_base_6": "drop_last",
    "multi_turn_base_24": "gt",
    "multi_turn_miss_func_1": "gt",
    "multi_turn_miss_func_49": "gt",
    "multi_turn_miss_func_3": "wrong_arg",
    "multi_turn_miss_param_3": "gt",
    "multi_turn_miss_param_5": "drop_last",
    "multi_turn_long_context_2": "gt",
    "multi_turn_long_context_7": "wrong_arg",
}


def replay_model(task_id: str, damage: str):
    """A model that sends each user turn's ground-truth calls in one message, then a plain reply."""
    task = load_task(task_id)
    turns = [[parse_call_string(c, task).to_dict() for c in gt] for gt in task.ground_truth]
    if damage == "drop_last":
        turns[-1] = []
    if damage == "wrong_arg":
        first = next(t for t in turns if t and any(c["arguments"] for c in t))
        call = next(c for c in first if c["arguments"])
        key = next(iter(call["arguments"]))
        call["arguments"][key] = "not-the-right-value"
    state = {"turn": 0, "sent": False}

    def generate(messages):
        t = state["turn"]
        if t < len(turns) and turns[t] and not state["sent"]:
            state["sent"] = True
            return render_step(turns[t]), {"prompt_tokens": 1, "completion_tokens": 1}
        state.update(turn=t + 1, sent=False)
        return "Done.", {"prompt_tokens": 1, "completion_tokens": 1}

    return generate


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    path = str(root / "results.jsonl")
    env = make_client(None)
    for task_id, damage in TASKS.items():
        record = run_episode(
            task_id, replay_model(task_id, damage), env, {}, None, 40, {"mode": "test"}, control=NO_MARKUP
        )
        append_record(path, record)
    return root, load_records(path)


def test_bfcl_scores_our_results_as_we_do(results):
    root, records = results
    ours = tables.accuracy_table(records)
    assert 0 < ours["average"].accuracy < 1, "the check needs passing and failing tasks"
    scores = score_with_bfcl(records, str(root / "bfcl"))
    assert set(scores) == {"base", "miss_func", "miss_param", "long_context"}
    for category, score in scores.items():
        assert score["total_count"] == ours[category].n
        assert score["correct_count"] == ours[category].passed, category
    failing = set()
    for category in scores:
        with open(score_file(str(root / "bfcl" / "score"), category)) as f:
            failing |= {json.loads(line)["id"] for line in f.read().splitlines()[1:]}
    assert failing == {r["task_id"] for r in records if not r["valid"]}
    assert "multi_turn_miss_func_49" in failing


def test_records_carry_turns_calls_and_verdicts(results):
    _, records = results
    by_id = {r["task_id"]: r for r in records}
    base0 = by_id["multi_turn_base_0"]
    assert base0["valid"] and base0["tags"] and set(base0["tags"]) <= {"pass", "correct_abstention"}
    assert len(base0["turns"]) == len(load_task("multi_turn_base_0").ground_truth)
    assert base0["turns"][0][0]["calls"] and base0["turns"][0][0]["reply"].startswith("<tool_response>")
    refused = by_id["multi_turn_miss_func_49"]
    assert not refused["valid"] and any(step["error_type"] for turn in refused["turns"] for step in turn)
    assert not by_id["multi_turn_base_6"]["valid"]
