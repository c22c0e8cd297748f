"""Capability state: exactness against SPEC B §6.3 written out independently here, persistence,
atomic writes and the run_id ownership rule."""

import json
import logging
import math
import os

import pytest

from seal import capability_state as cs
from seal.capability_state import CapabilityState, CapabilityStats, turn_position_bucket

BASE = {
    "spurious_tool_call": 2.0,
    "correct_abstention": 1.8,
    "empty_turn_model_response": 1.5,
    "state_mismatch": 1.0,
    "response_mismatch": 0.9,
    "instance_mismatch": 0.6,
    "pass": 1.0,
}
EXCLUDED = ("checker_error", "gt_error")


# ------------------------------------------------------------------ independent reference (SPEC §6.3)
def ref_tag_counts(observations):
    """observations: list of (reward, tags). Every tag occurrence counts; [] → ['unknown']."""
    counts, reward_sums = {}, {}
    for reward, tags in observations:
        for t in (tags or ["unknown"]):
            counts[t] = counts.get(t, 0) + 1
            reward_sums[t] = reward_sums.get(t, 0.0) + reward
    return counts, reward_sums


def ref_update(window_obs, total_obs, base, prev, lo, hi, beta, alpha, C, excluded=EXCLUDED):
    """Returns (weights used by A-Patch, stored dynamic weights after the call)."""
    source = window_obs if window_obs else total_obs
    counts, reward_sums = ref_tag_counts(source)
    n = 0
    for t, c in counts.items():
        if t not in excluded:
            n += c
    if n == 0:
        return dict(base), dict(prev)
    new = {}
    for t in set(base) | set(counts) | set(prev):
        b = base.get(t, 1.0)
        if t in excluded:
            target = 1.0
        elif t == "pass":
            target = b
        else:
            c = counts.get(t, 0)
            mean = reward_sums[t] / c if c else 0.0
            conf = c / C if c / C < 1 else 1.0
            target = b * (1 + alpha * (c / n) * (1 - mean) * conf)
        if target < lo:
            target = lo
        if target > hi:
            target = hi
        p = prev[t] if t in prev else b
        new[t] = (1 - beta) * p + beta * target
    return new, new


def assert_weights_equal(got, want):
    assert set(got) == set(want)
    for t in want:
        assert got[t] == pytest.approx(want[t], abs=1e-12), t


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


# ------------------------------------------------------------------ dynamic weights
def _batch(rng, n):
    vocab = ["pass", "pass", "pass", "correct_abstention", "spurious_tool_call", "state_mismatch",
             "response_mismatch", "empty_turn_model_response", "instance_mismatch", "checker_error",
             "gt_error", "brand_new_tag"]
    out = []
    for _ in range(n):
        k = rng.randint(0, 6)  # 0 → no tags → unknown
        tags = [rng.choice(vocab) for _ in range(k)]
        reward = 1.0 if tags and all(t in ("pass", "correct_abstention") for t in tags) else 0.0
        out.append((reward, tags))
    return out


def test_dynamic_weights_over_consecutive_steps_with_windows_and_totals():
    import random

    rng = random.Random(1234)
    s = CapabilityState()
    lo, hi, beta, alpha, C = 0.5, 2.0, 0.25, 1.0, 32
    window, total, prev = [], [], {}
    step = 0
    for epoch in range(3):
        for _ in range(3):
            step += 1
            batch = _batch(rng, 40)
            for i, (reward, tags) in enumerate(batch):
                s.observe("cat", f"task_{i % 5}", reward, reward >= 1, tags, epoch, step)
            window += batch
            total += batch
            got = s.update_dynamic_tag_weights(BASE, lo, hi, beta, alpha, C)
            want, prev = ref_update(window, total, BASE, prev, lo, hi, beta, alpha, C)
            assert_weights_equal(got, want)
            assert_weights_equal(s.dynamic_tag_weights, prev)
        # epoch end: window reset; an update before the next observation uses the totals
        s.reset_window()
        window = []
        got = s.update_dynamic_tag_weights(BASE, lo, hi, beta, alpha, C)
        want, prev = ref_update(window, total, BASE, prev, lo, hi, beta, alpha, C)
        assert_weights_equal(got, want)
    # the excluded tags are present and pinned toward 1.0, new tags appear with base 1.0
    assert "checker_error" in prev and "brand_new_tag" in prev and "unknown" in prev


def test_dynamic_small_example_by_hand():
    s = CapabilityState()
    # 2 trajectories: [spurious, pass] r=0 ; [pass] r=1 ; [checker_error] r=0
    s.observe("c", "a", 0.0, False, ["spurious_tool_call", "pass"], 0, 1)
    s.observe("c", "b", 1.0, True, ["pass"], 0, 1)
    s.observe("c", "c", 0.0, False, ["checker_error"], 0, 1)
    w = s.update_dynamic_tag_weights(BASE, 0.5, 2.0, 0.25, 1.0, 2)
    # N = 3 (checker_error excluded); spurious: count 1, mean 0 → 2.0*(1+1*(1/3)*1*min(1,1/2)) = 2.333 → clamp 2.0
    assert w["spurious_tool_call"] == pytest.approx(0.75 * 2.0 + 0.25 * 2.0)
    assert w["pass"] == pytest.approx(1.0)
    assert w["checker_error"] == pytest.approx(1.0)
    # tag unseen in source: target = base → stays at base
    assert w["instance_mismatch"] == pytest.approx(0.6)
    # with a lower base the prevalence boost shows: response_mismatch seen once, mean 0
    s2 = CapabilityState()
    s2.observe("c", "a", 0.0, False, ["response_mismatch", "pass", "pass", "pass"], 0, 1)
    w2 = s2.update_dynamic_tag_weights(BASE, 0.5, 2.0, 0.5, 1.0, 4)
    target = 0.9 * (1 + 1.0 * 0.25 * 1.0 * 0.25)
    assert w2["response_mismatch"] == pytest.approx(0.5 * 0.9 + 0.5 * target)


def test_dynamic_only_excluded_tags_returns_base_and_stores_nothing():
    s = CapabilityState()
    s.observe("c", "a", 0.0, False, ["checker_error", "gt_error"], 0, 1)
    assert s.update_dynamic_tag_weights(BASE, 0.5, 2.0, 0.25, 1.0, 32) == BASE
    assert s.dynamic_tag_weights == {}


def test_dynamic_zero_beta_and_zero_alpha_are_respected():
    s = CapabilityState()
    s.observe("c", "a", 0.0, False, ["response_mismatch"] * 40, 0, 1)
    assert s.update_dynamic_tag_weights(BASE, 0.5, 2.0, 0.0, 1.0, 32)["response_mismatch"] == 0.9
    assert s.update_dynamic_tag_weights(BASE, 0.5, 2.0, 1.0, 0.0, 32)["response_mismatch"] == pytest.approx(0.9)
    # confidence_samples 0 behaves as 1 (full confidence), no division by zero
    w = CapabilityState()
    w.observe("c", "a", 0.0, False, ["response_mismatch", "pass"], 0, 1)
    assert w.update_dynamic_tag_weights(BASE, 0.5, 2.0, 1.0, 1.0, 0)["response_mismatch"] == pytest.approx(0.9 * 1.5)


def test_dynamic_rejects_bad_beta():
    with pytest.raises(ValueError, match="ema_beta"):
        CapabilityState().update_dynamic_tag_weights(BASE, 0.5, 2.0, 1.5, 1.0, 32)


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
            "multi_turn_base": {"pass": {"count": 1, "reward_mean": 0.0}, "state_mismatch": {"count": 1, "reward_mean": 0.0}},
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
    s.update_dynamic_tag_weights(BASE, 0.5, 2.0, 0.25, 1.0, 32)
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
    assert s.update_dynamic_tag_weights(BASE, 0.5, 2.0, 0.25, 1.0, 32) == other.update_dynamic_tag_weights(
        BASE, 0.5, 2.0, 0.25, 1.0, 32
    )


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
