"""Capability state: counting (every bucket, window and total), the failure profile, persistence, atomic writes
and the run_id ownership rule. The closed-loop formula that reads the state is tested in tests/step/test_apatch.py."""

import json
import logging
import math
import os

import pytest

from seal import capability_state as cs
from seal.apatch import DEFAULT_TAG_WEIGHTS, APatchConfig, dynamic_weights
from seal.capability_state import CapabilityState, CapabilityStats, turn_position_bucket


def closed_loop_step(state):
    """What a training step does to the state's weights (the formula itself is tested in tests/step/test_apatch.py)."""
    moved = dynamic_weights(DEFAULT_TAG_WEIGHTS, state.dynamic_tag_weights, state.tag_evidence(), APatchConfig())
    if moved is not None:
        state.dynamic_tag_weights = moved
    return moved


# ------------------------------------------------------------------ position buckets
@pytest.mark.parametrize(
    "total,expected",
    [
        (1, ["only"]),
        (2, ["middle", "late"]),
        (3, ["early", "middle", "late"]),
        (4, ["early", "middle", "late", "late"]),
        (5, ["early", "middle", "middle", "late", "late"]),
        (6, ["early", "early", "middle", "middle", "late", "late"]),
    ],
)
def test_position_bucket_table(total, expected):
    # rule: only if n<=1, else r=(i+1)/n: early r<=1/3, middle r<=2/3, late otherwise
    assert [turn_position_bucket(i, total) for i in range(total)] == expected


def test_position_bucket_exact_thirds():
    # (i+1)/n exactly 1/3 and 2/3 fall in the lower bucket
    assert turn_position_bucket(2, 9) == "early"  # 3/9
    assert turn_position_bucket(3, 9) == "middle"  # 4/9
    assert turn_position_bucket(5, 9) == "middle"  # 6/9
    assert turn_position_bucket(6, 9) == "late"  # 7/9


# ------------------------------------------------------------------ observe
def test_observe_counts_every_occurrence_and_all_buckets():
    s = CapabilityState(run_id="r")
    dom = s.observe("multi_turn_base", "multi_turn_base_1", 1.0, True, ["pass", "pass", "pass"], 0, 1)
    assert dom == "pass"
    assert s.total["tags"]["pass"].count == 3
    assert s.total["tags"]["pass"].success == 3
    assert s.total["categories"]["multi_turn_base"].count == 1
    assert s.total["category_tags"]["multi_turn_base::pass"].count == 3
    assert s.total["turn_positions"] == {
        "early::pass": CapabilityStats(1, 1, 1.0, 0),
        "middle::pass": CapabilityStats(1, 1, 1.0, 0),
        "late::pass": CapabilityStats(1, 1, 1.0, 0),
    }
    assert s.window["tags"]["pass"].count == 3
    assert (s.observe_count, s.last_step, s.last_epoch) == (1, 1, 0)


def test_observe_empty_tags_become_unknown_and_partial_rewards():
    s = CapabilityState()
    s.observe("c", "t1", 0.5, False, [], 0, 1)
    s.observe("c", "t1", 0.0, False, None, 0, 2)
    st = s.total["tags"]["unknown"]
    assert (st.count, st.success, st.partial_count) == (2, 0, 1)
    assert st.reward_mean == pytest.approx(0.25)
    assert s.total["turn_positions"]["only::unknown"].count == 2
    assert s.tasks["t1"]["last_tag"] == "unknown"


def test_task_record_fields_and_last_tag_rule():
    s = CapabilityState()
    s.observe("c", "t", 0.0, False, ["pass", "state_mismatch", "response_mismatch", "response_mismatch"], 1, 7)
    rec = s.tasks["t"]
    assert rec["last_tag"] == "response_mismatch"  # most common non-pass
    s.observe("c", "t", 0.0, False, ["spurious_tool_call", "pass", "state_mismatch"], 1, 8)
    assert s.tasks["t"]["last_tag"] == "spurious_tool_call"  # tie → first seen
    s.observe("c", "t", 1.0, True, ["pass", "pass"], 1, 9)
    rec = s.tasks["t"]
    assert rec["last_tag"] == "pass"
    assert rec["count"] == 3 and rec["success"] == 1 and rec["reward_sum"] == 1.0
    assert rec["last_reward"] == 1.0 and rec["last_success"] is True and rec["last_step"] == 9
    assert rec["category"] == "c"
    assert rec["tag_counts"] == {"pass": 4, "state_mismatch": 2, "response_mismatch": 2, "spurious_tool_call": 1}


def test_reset_window_keeps_totals():
    s = CapabilityState()
    s.observe("c", "t", 1.0, True, ["pass"], 0, 1)
    s.reset_window()
    assert s.window["tags"] == {} and s.window["categories"] == {}
    assert s.total["tags"]["pass"].count == 1


# ------------------------------------------------------------------ failure profile
def test_failure_profile_window_then_total():
    s = CapabilityState()
    s.observe("multi_turn_base", "a", 0.0, False, ["state_mismatch", "pass"], 0, 3)
    s.observe("multi_turn_miss_func", "b", 1.0, True, ["correct_abstention"], 0, 3)
    p = s.failure_profile(per_category=True)
    assert p == {
        "step": 3,
        "tags": {
            "correct_abstention": {"count": 1, "reward_mean": 1.0},
            "pass": {"count": 1, "reward_mean": 0.0},
            "state_mismatch": {"count": 1, "reward_mean": 0.0},
        },
        "categories": {
            "multi_turn_base": {
                "pass": {"count": 1, "reward_mean": 0.0},
                "state_mismatch": {"count": 1, "reward_mean": 0.0},
            },
            "multi_turn_miss_func": {"correct_abstention": {"count": 1, "reward_mean": 1.0}},
        },
    }
    assert s.failure_profile()["categories"] == {}
    s.reset_window()
    s.observe("multi_turn_base", "a", 1.0, True, ["pass"], 1, 4)
    assert s.failure_profile()["tags"] == {"pass": {"count": 1, "reward_mean": 1.0}}  # window only
    s.reset_window()
    assert s.failure_profile()["tags"]["pass"] == {"count": 2, "reward_mean": 0.5}  # totals


# ------------------------------------------------------------------ persistence
def _filled_state(run_id="run-a"):
    s = CapabilityState(run_id=run_id)
    s.observe("multi_turn_base", "multi_turn_base_1", 0.0, False, ["state_mismatch", "pass"], 0, 1)
    s.observe("multi_turn_base", "multi_turn_base_1", 1.0, True, ["pass", "pass"], 0, 1)
    closed_loop_step(s)
    return s


def test_save_load_round_trip_indent2(tmp_path):
    s = _filled_state()
    path = tmp_path / "sub" / "capability_state.json"
    s.save(str(path))
    text = path.read_text()
    assert text.startswith('{\n  "')
    loaded = CapabilityState.load(str(path))
    assert loaded.state_dict() == s.state_dict()
    assert loaded.run_id == "run-a"
    assert json.loads(text)["total_tags"]["pass"] == {"count": 3, "success": 2, "reward_sum": 2.0, "partial_count": 0}


def test_state_dict_round_trip_into_new_object():
    s = _filled_state()
    other = CapabilityState()
    other.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert other.state_dict() == s.state_dict()
    # continuing after restore gives the same weights as continuing the original
    for st in (s, other):
        st.observe("c", "x", 0.0, False, ["spurious_tool_call"], 1, 2)
    assert closed_loop_step(s) == closed_loop_step(other)


def test_saved_file_gets_the_mode_a_plain_write_would(tmp_path):
    umask = os.umask(0o022)
    try:
        path = tmp_path / "capability_state.json"
        _filled_state().save(str(path))
        assert path.stat().st_mode & 0o777 == 0o644  # not the 0600 of a temporary file
        path.chmod(0o640)
        _filled_state().save(str(path))
        assert path.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
    finally:
        os.umask(umask)


def test_atomic_write_crash_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "capability_state.json"
    old = _filled_state()
    old.save(str(path))
    before = path.read_bytes()
    new = _filled_state()
    new.observe("c", "t", 0.0, False, ["gt_error"], 5, 50)

    def boom(src, dst):
        raise OSError("simulated crash during replace")

    monkeypatch.setattr(cs.os, "replace", boom)
    with pytest.raises(OSError, match="simulated"):
        new.save(str(path))
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["capability_state.json"]


def test_atomic_write_crash_on_first_save_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cs.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        _filled_state().save(str(tmp_path / "capability_state.json"))
    assert os.listdir(tmp_path) == []


def test_open_ownership_rule(tmp_path, caplog):
    path = str(tmp_path / "capability_state.json")
    # no file → fresh
    s = CapabilityState.open(path, "run-a", resume=True)
    assert s.observe_count == 0 and s.run_id == "run-a" and s.path == path
    _filled_state("run-a").save(path)

    # resume, same run → restored
    s = CapabilityState.open(path, "run-a", resume=True)
    assert s.observe_count == 2 and s.dynamic_tag_weights

    # resume requested but the file belongs to another run → fresh + loud warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seal.capability_state"):
        s = CapabilityState.open(path, "run-b", resume=True)
    assert s.observe_count == 0 and s.dynamic_tag_weights == {} and s.run_id == "run-b"
    assert any("NOT inheriting" in r.message and "run-a" in r.message for r in caplog.records)

    # fresh run (resume False) with the same run id → fresh + warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="seal.capability_state"):
        s = CapabilityState.open(path, "run-a", resume=False)
    assert s.observe_count == 0
    assert any("NOT inheriting" in r.message for r in caplog.records)

    # the fresh state's first save replaces the foreign file with its own
    s.observe("c", "t", 1.0, True, ["pass"], 0, 1)
    s.save()
    assert CapabilityState.load(path).observe_count == 1


def test_open_corrupt_file_while_resuming_is_an_error(tmp_path):
    path = tmp_path / "capability_state.json"
    path.write_text('{"total_tags": ')
    with pytest.raises(ValueError, match="not valid JSON"):
        CapabilityState.open(str(path), "run-a", resume=True)
    assert CapabilityState.open(str(path), "run-a", resume=False).observe_count == 0


def test_save_without_path_is_an_error():
    with pytest.raises(ValueError):
        CapabilityState().save()


def test_reward_must_be_finite():
    with pytest.raises(ValueError):
        CapabilityState().observe("c", "t", math.nan, False, ["pass"], 0, 1)
