"""The results file (resumable, torn-line safe), task selection, the eval dataset, and the table's statistics."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
from scipy.stats import binomtest

from env_service.bfcl.tasks import task_ids
from seal.eval.tasks import EVAL_SPLIT, select_tasks, write_eval_dataset
from seal.results import tables
from seal.results.records import TurnLog, append_record, finished_tasks, load_records, make_record


def record(task_id, valid, tags=("pass",), labels=("pass",), failed=False):
    evaluation = {"valid": valid, "reward": float(valid), "tags": list(tags), "labels": list(labels)}
    return make_record(
        task_id,
        None if failed else evaluation,
        [],
        model_calls=1,
        termination="completed",
        tokens={"prompt": 1, "completion": 1},
        source={},
        failed=failed,
    )


def test_results_file_resumes_and_survives_a_torn_line(tmp_path):
    path = str(tmp_path / "results.jsonl")
    append_record(path, record("multi_turn_base_1", True))
    append_record(path, record("multi_turn_base_2", False, failed=True))
    with open(path, "a") as f:
        f.write('{"task_id": "multi_turn_base_3", "valid": tr')  # interrupted mid-line
    assert finished_tasks(path) == {"multi_turn_base_1"}  # the failed one is retried, the torn one too
    append_record(path, record("multi_turn_base_2", True))  # the retry's record wins
    valid = {r["task_id"]: r["valid"] for r in load_records(path)}
    assert valid == {"multi_turn_base_1": True, "multi_turn_base_2": True}


def test_accuracy_and_binomial_standard_errors():
    records = (
        [record(f"multi_turn_base_{i}", i < 3) for i in range(4)]
        + [record(f"multi_turn_miss_func_{i}", i < 1) for i in range(5)]
        + [record("multi_turn_long_context_0", False, failed=True)]
    )
    table = tables.accuracy_table(records)
    assert table["base"].accuracy == 0.75 and table["base"].n == 4
    assert table["base"].stderr == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert table["miss_func"].accuracy == 0.2 and "long_context" not in table  # env failures left out
    assert table["average"].accuracy == pytest.approx((0.75 + 0.2) / 2)
    # both categories are small (fewer than 5 failures, passes): each enters with its Wilson half-width / z (scipy's)
    half = []
    for passed, n in ((3, 4), (1, 5)):
        ci = binomtest(passed, n).proportion_ci(confidence_level=0.95, method="wilson")
        half.append((ci.high - ci.low) / 2 / 1.959964)
    assert table["average"].stderr == pytest.approx(math.hypot(*half) / 2)
    assert table["average"].passed is None  # 4 and 5 tasks: the mean (47.5 %) is not the pooled 4/9


def test_failure_profile_shares_per_category():
    records = [
        record("multi_turn_base_0", False, tags=("pass", "state_mismatch"), labels=("pass", "state_mismatch")),
        record(
            "multi_turn_base_1",
            False,
            tags=("empty_turn_model_response", "state_mismatch"),
            labels=("missing_tool_call", "state_mismatch"),
        ),
    ]
    profile = tables.failure_profile(records)
    assert profile["tags"]["base"] == {"empty_turn_model_response": 0.25, "pass": 0.25, "state_mismatch": 0.5}
    assert profile["labels"]["all"]["missing_tool_call"] == 0.25


def test_write_report_files(tmp_path):
    path = str(tmp_path / "results.jsonl")
    for i in range(3):
        append_record(path, record(f"multi_turn_miss_param_{i}", i == 0))
    summary = tables.write_report(path, str(tmp_path), "m")
    assert summary["table"]["miss_param"]["passed"] == 1
    # 1 of 3 passed: too few for ± se; the 95 % Wilson interval (by hand: (p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) /
    # (1 + z²/n) with z = 1.96), and an Average over one category says so
    assert "| m | 33.33 [6.15, 79.23] (1 of 4 categories) |" in (tmp_path / "table.md").read_text()
    # the Average's SE, which averages and differences combine, is that interval's half-width / z (scipy's Wilson)
    ci = binomtest(1, 3).proportion_ci(confidence_level=0.95, method="wilson")
    average_se = 100 * (ci.high - ci.low) / 2 / 1.959964
    assert (tmp_path / "table.csv").read_text().splitlines()[1].startswith(f"m,33.3333,{average_se:.4f},3")


def test_task_selection():
    assert select_tasks() == task_ids("heldout") and len(select_tasks()) == 400
    assert len(select_tasks("train", category="miss_func")) == 100
    limited = select_tasks("heldout", limit=2)
    assert len(limited) == 8 and limited[:2] == [t for t in task_ids("heldout") if "_base_" in t][:2]
    assert select_tasks(ids=["multi_turn_base_3", "multi_turn_base_3"]) == ["multi_turn_base_3"]
    with pytest.raises(ValueError, match="unknown task ids"):
        select_tasks(ids=["multi_turn_base_999"])


def test_eval_dataset_runs_train_tasks_in_validate_mode(tmp_path):
    train, heldout = task_ids("train")[0], task_ids("heldout")[5]
    path = write_eval_dataset([heldout, train], str(tmp_path / "tasks.parquet"))
    rows = pq.read_table(path).to_pylist()
    assert [r["extra_info"]["task_id"] for r in rows] == [heldout, train]
    assert {r["extra_info"]["split"] for r in rows} == {EVAL_SPLIT}
    assert pq.read_table(path).schema == pq.read_table("data/bfcl_heldout.parquet").schema


def test_turn_log_follows_the_environment_turns():
    log = TurnLog()
    log.add(
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>',
        {"content": "r"},
        {"num_calls": 1, "advanced": False},
    )
    log.add("<tool_call>{bad</tool_call>", {"content": "[ERROR]"}, {"num_calls": 0, "error_type": "parse_error"})
    log.add("done", {"content": "next question"}, {"num_calls": 0, "advanced": True})
    log.add("done", {"content": "[CONVERSATION_COMPLETED]"}, {"num_calls": 0, "advanced": True}, terminated=True)
    turns = log.as_list()
    assert len(turns) == 2 and len(turns[0]) == 3
    assert turns[0][0]["calls"] == [{"name": "ls", "arguments": {}}] and turns[0][1]["calls"] == []


def test_a_training_checkpoint_means_its_huggingface_export(tmp_path):
    from seal.eval.checkpoint import resolve_model

    step = tmp_path / "global_step_4"
    (step / "actor" / "huggingface").mkdir(parents=True)
    assert resolve_model(str(step)) == str(step)  # no export yet: the launcher's preflight names the problem
    (step / "actor" / "huggingface" / "config.json").write_text("{}")
    assert resolve_model(str(step)) == str(step)  # verl's config without weights is no model
    (step / "actor" / "huggingface" / "model.safetensors").write_text("")
    assert resolve_model(str(step)) == str(step / "actor" / "huggingface")
    (step / "huggingface").mkdir()
    (step / "huggingface" / "config.json").write_text("{}")
    (step / "huggingface" / "model.safetensors").write_text("")
    assert resolve_model(str(step)) == str(step / "huggingface")
    assert resolve_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    # the checkpoint folder means its latest checkpoint: the last step of a run that saved it
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert resolve_model(str(tmp_path)) == str(step / "huggingface")


def test_small_samples_show_a_wilson_interval_not_a_zero_error():
    assert tables.pct(tables.binomial_cell(0, 2)) == "0.00 [0.00, 65.76]"  # not "0.00 ± 0.00"
    assert tables.pct(tables.binomial_cell(2, 2)) == "100.00 [34.24, 100.00]"
    assert tables.pct(tables.binomial_cell(40, 100)) == "40.00 ± 4.90"  # enough of both: the binomial SE
