"""Diagnostics: window metrics, error-string counting, vocabulary forwarding, dumps, plot."""

import json
import os
from pathlib import Path

import pytest

from env_service.vocabulary import task_category
from seal.apatch import APatchConfig, dynamic_weights
from seal.capability_state import CapabilityState
from seal.diagnostics import DiagnosticStats, find_errors, plot_over_steps


def move_weights(state, base):
    """One closed-loop step on ``state`` (what apply_apatch does before scaling)."""
    state.dynamic_tag_weights = dynamic_weights(base, state.dynamic_tag_weights, state.tag_evidence(), APatchConfig())


def traj(task_id, reward, tags, labels=None, env_texts=(), category=None, **extra):
    t = {"task_id": task_id, "reward": reward, "tags": tags, "labels": labels or [], "env_texts": list(env_texts)}
    if category:
        t["category"] = category
    t.update(extra)
    return t


BATCH = [
    traj("multi_turn_base_1", 1.0, ["pass", "pass"], ["pass", "pass"]),
    traj(
        "multi_turn_base_1",
        0.0,
        ["state_mismatch", "pass"],
        ["argument_mismatch", "pass"],
        ['{"error": "No such file or directory"}', "[ERROR] Invalid tool call format: bad json\nmore"],
    ),
    traj(
        "multi_turn_miss_func_3",
        0.0,
        ["spurious_tool_call"],
        ["invalid_tool_call"],
        ["Error from environment: boom] tail", '{"error": "No such file or directory"}'],
    ),
    traj("x", 0.5, [], None, category="custom"),
]


def test_window_metrics_and_state_metrics():
    d = DiagnosticStats(CapabilityState())
    d.observe_batch(BATCH, epoch=0, global_step=1)
    m = d.metrics()
    # independent expectation per category
    expect = {}
    for t in BATCH:
        cat = t.get("category") or ("multi_turn_base" if "base" in t["task_id"] else "multi_turn_miss_func")
        e = expect.setdefault(cat, [0, 0, 0.0, 0])
        e[0] += 1
        e[1] += int(t["reward"] >= 1)
        e[2] += t["reward"]
        e[3] += int(0 < t["reward"] < 1)
    for cat, (n, succ, rsum, part) in expect.items():
        assert m[f"seal/window/{cat}/count"] == n
        assert m[f"seal/window/{cat}/success_rate"] == pytest.approx(succ / n)
        assert m[f"seal/window/{cat}/reward_mean"] == pytest.approx(rsum / n)
        assert m[f"seal/window/{cat}/partial_count"] == part
    assert m["seal/state/observe_count"] == 4
    assert m["seal/state/num_tasks"] == 3
    assert m["seal/state/num_tags"] == 4  # pass, state_mismatch, spurious_tool_call, unknown
    assert m["seal/state/num_category_tags"] == 4
    assert not any("dynamic_tag_weight" in k for k in m)
    move_weights(d.state, {"pass": 1.0})
    assert "seal/state/dynamic_tag_weight/pass" in d.metrics()


def test_success_flag_counts_even_with_partial_reward():
    d = DiagnosticStats()
    d.observe_batch([traj("multi_turn_base_2", 0.5, ["pass"], success=True)], 0, 1)
    assert d.metrics()["seal/window/multi_turn_base/success_rate"] == 1.0


@pytest.mark.parametrize("vocabulary,field", [("progress_tags", "tags"), ("paper_labels", "labels")])
def test_state_is_fed_the_apatch_vocabulary(vocabulary, field):
    d = DiagnosticStats(CapabilityState(), vocabulary=vocabulary)
    d.observe_batch(BATCH, 0, 1)
    expected = {}
    for t in BATCH:
        for item in t[field] or ["unknown"]:
            expected[item] = expected.get(item, 0) + 1
    assert {k: s.count for k, s in d.state.total["tags"].items()} == expected


def test_error_patterns():
    assert find_errors('x {"error": "No such file"} y [ERROR] Invalid tool call format: z\nq') == [
        "[ERROR] Invalid tool call format: z",
        "No such file",
    ]
    assert find_errors("Error from environment: it broke] rest") == ["Error from environment: it broke"]
    assert find_errors("[ERROR] " + "a" * 500) == ["[ERROR] " + "a" * 192]  # first 200 chars
    assert find_errors("all good") == []


def test_dump_contents_and_reset(tmp_path):
    state = CapabilityState()
    d = DiagnosticStats(state)
    d.observe_batch(BATCH, 0, 5)
    move_weights(state, {"pass": 1.0, "spurious_tool_call": 2.0})
    path = d.dump(str(tmp_path / "diag"), epoch=0, global_step=5)
    assert os.path.basename(path) == "epoch_0.json"
    data = json.loads(Path(path).read_text())
    assert set(data) >= {
        "epoch",
        "global_step",
        "categories",
        "tags",
        "category_tags",
        "turn_positions",
        "tasks",
        "dynamic_tag_weights",
        "top_errors",
        "labels",
    }
    assert data["epoch"] == 0 and data["global_step"] == 5
    assert data["top_errors"][0] == ["No such file or directory", 2]
    assert {e for e, _ in data["top_errors"]} == {
        "No such file or directory",
        "[ERROR] Invalid tool call format: bad json",
        "Error from environment: boom",
    }
    assert data["tags"]["pass"]["count"] == 3
    assert data["labels"]["argument_mismatch"]["count"] == 1 and data["labels"]["unknown"]["count"] == 1
    assert data["turn_positions"]["middle::state_mismatch"]["count"] == 1
    assert data["tasks"]["multi_turn_base_1"]["count"] == 2
    assert set(data["dynamic_tag_weights"]) >= {"pass", "spurious_tool_call"}

    d.reset_window()
    assert state.window["tags"] == {} and d.metrics().get("seal/window/multi_turn_base/count") is None
    assert state.total["tags"]["pass"].count == 3  # totals survive
    assert d.snapshot()["top_errors"] == []


def test_top_errors_limited_to_20(tmp_path):
    d = DiagnosticStats()
    d.observe_batch([traj(f"t_{i}", 0.0, ["pass"], env_texts=[f"[ERROR] e{i}"] * (i + 1)) for i in range(30)], 0, 1)
    data = json.loads(Path(d.dump(str(tmp_path), 0, 1)).read_text())
    assert len(data["top_errors"]) == 20 and data["top_errors"][0] == ["[ERROR] e29", 30]


def test_category_from_task_id():
    assert task_category("multi_turn_long_context_17") == "multi_turn_long_context"
    assert task_category("multi_turn_miss_param_0") == "multi_turn_miss_param"
    assert task_category("webshop_12") == "webshop"
    assert task_category(None) == "_none"


@pytest.mark.parametrize("vocabulary", ["progress_tags", "paper_labels"])
def test_dump_counts_both_vocabularies_whichever_drives(tmp_path, vocabulary):
    d = DiagnosticStats(CapabilityState(), vocabulary=vocabulary)
    d.observe_batch(BATCH, 0, 1)
    data = json.loads(Path(d.dump(str(tmp_path), 0, 1)).read_text())
    for key, field in (("progress_tags", "tags"), ("labels", "labels")):
        expected = {}
        for t in BATCH:
            for item in t[field] or ["unknown"]:
                expected[item] = expected.get(item, 0) + 1
        assert {k: v["count"] for k, v in data[key].items()} == expected, key
    assert data["categories"]["multi_turn_base"]["count"] == 2 and data["categories"]["custom"]["count"] == 1


def test_bad_vocabulary():
    with pytest.raises(ValueError, match="vocabulary"):
        DiagnosticStats(vocabulary="labels")


def test_plot_over_steps_png(tmp_path):
    history = [
        (step, {"pass": 1.0, "spurious_tool_call": 2.0 - 0.1 * step, "new": 1.0 + 0.05 * step}) for step in range(1, 6)
    ]
    path = plot_over_steps(history, str(tmp_path / "plots" / "w.png"))
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000
    plot_over_steps({1: {"pass": 1.0}}, str(tmp_path / "one.png"))
    plot_over_steps([], str(tmp_path / "empty.png"))


def test_finalize_epoch_dumps_then_resets_then_saves(tmp_path):
    state = CapabilityState(run_id="r", path=str(tmp_path / "state" / "capability_state.json"))
    d = DiagnosticStats(state)
    d.observe_batch(BATCH, epoch=2, global_step=24)
    path = d.finalize_epoch(str(tmp_path / "stats"), epoch=2, global_step=24)
    assert json.loads(Path(path).read_text())["tags"]["pass"]["count"] == 3  # dump saw the window
    saved = CapabilityState.load(state.path)
    assert saved.window["tags"] == {} and saved.total["tags"]["pass"].count == 3  # saved after reset
    assert d.failure_profile()["tags"]["pass"] == {
        "count": 3,
        "reward_mean": pytest.approx(2 / 3),
    }  # 2 of 3 pass turns in rewarded trajectories


def test_failed_episodes_are_not_observed(tmp_path):
    d = DiagnosticStats(CapabilityState())
    d.observe_batch([traj("multi_turn_base_1", 0.0, None, failed=True), traj("multi_turn_base_1", 1.0, ["pass"])], 0, 1)
    assert d.state.observe_count == 1 and "unknown" not in d.state.total["tags"]
    assert d.metrics()["seal/window/multi_turn_base/count"] == 1
    assert json.loads(Path(d.dump(str(tmp_path), 0, 1)).read_text())["failed_episodes"] == 1


def test_plot_accepts_step_dict_history(tmp_path):
    history = [{"step": s, "pass": 1.0, "spurious_tool_call": 2.0 - 0.1 * s} for s in range(1, 4)]
    path = plot_over_steps(history, str(tmp_path / "w.png"))
    assert Path(path).read_bytes()[:4] == b"\x89PNG"
