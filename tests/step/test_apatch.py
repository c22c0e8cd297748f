"""A-Patch: exactness of the scaling and of the closed-loop weight update against the formulas of docs/method.md,
written out independently here (plain loops); config validation; composition with verl's GRPO advantage.

These are the project's only reference formulas for A-Patch; tests/step/test_capability_state.py tests the counting."""

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from env_service.vocabulary import SCORER_TAGS
from seal.apatch import (
    DEFAULT_LABEL_WEIGHTS,
    DEFAULT_TAG_WEIGHTS,
    APatchConfig,
    apply_apatch,
    dynamic_weights,
    per_row_scales,
    resolve_weights,
)
from seal.capability_state import CapabilityState

# The released recipe's static weights, as the recipe defaults carry them (test_default_weights_are_upstreams checks
# that the code's table is the same).
UPSTREAM = dict(
    OmegaConf.load(Path(__file__).resolve().parents[2] / "seal/config/seal_defaults.yaml").seal.apatch.tag_weights
)
EXCLUDED = SCORER_TAGS


# ------------------------------------------------------------------ independent reference: the static scale
def ref_scale(tags, weights, lo, hi, excluded=EXCLUDED):
    if not tags:
        return 1.0
    total, n = 0.0, 0
    for t in tags:
        if t in excluded:
            continue
        total += weights[t] if t in weights else 1.0
        n += 1
    if n == 0:
        return 1.0
    s = total / n
    return lo if s < lo else hi if s > hi else s


def ref_budget(scales, tagged, strength, lo, hi, target_mean):
    out = list(scales)
    sel = []
    for i in tagged:
        v = 1 + strength * (scales[i] - 1)
        sel.append(min(hi, max(lo, v)))
    if target_mean is not None and sel:
        m = sum(sel) / len(sel)
        sel = [min(hi, max(lo, v * target_mean / m)) for v in sel]
    for i, v in zip(tagged, sel):
        out[i] = v
    return out


def ref_apply(adv, scales, mode):
    out = []
    for i, row in enumerate(adv):
        new_row = []
        for a in row:
            if mode == "all" or (mode == "positive_advantage" and a > 0) or (mode == "negative_advantage" and a < 0):
                new_row.append(a * scales[i])
            else:
                new_row.append(a)
        out.append(new_row)
    return out


def cfg(**kw):
    kw.setdefault("enable", True)
    return APatchConfig.from_dict(kw)


def static_cfg(**kw):
    kw.setdefault("dynamic", {"enable": False})
    return cfg(**kw)


# ------------------------------------------------------------------ defaults and static scales
def test_default_weights_are_upstreams():
    assert DEFAULT_TAG_WEIGHTS == UPSTREAM
    c = APatchConfig()
    assert (c.enable, c.min_scale, c.max_scale, c.apply_to, c.metric_prefix, c.warmup_steps) == (
        False,
        0.5,
        2.0,
        "all",
        "seal/apatch",
        0,
    )
    assert (c.dynamic.enable, c.dynamic.ema_beta, c.dynamic.prevalence_alpha, c.dynamic.confidence_samples) == (
        True,
        0.25,
        1.0,
        32,
    )
    assert c.excluded_tags == EXCLUDED and c.vocabulary == "progress_tags" and c.budget.enable is False
    assert resolve_weights(c) == UPSTREAM


def test_static_example_from_spec():
    adv = torch.tensor([[1.0, 2.0, 0.0]])
    out, m = apply_apatch(adv, [["pass", "correct_abstention", "pass"]], static_cfg(), global_step=1)
    s = (1.0 + 1.8 + 1.0) / 3
    assert s == pytest.approx(1.2667, abs=1e-4)
    assert torch.allclose(out, adv * s)
    assert m["seal/apatch/mean_scale"] == pytest.approx(s)
    assert m["seal/apatch/scaled_count"] == 1.0 and m["seal/apatch/missing_tag_count"] == 0.0
    assert m["seal/apatch/tag_frac/pass"] == pytest.approx(2 / 3)
    assert m["seal/apatch/tag_frac/correct_abstention"] == pytest.approx(1 / 3)
    assert m["seal/apatch/tag_weight/correct_abstention"] == 1.8
    assert m["seal/apatch/dynamic_enabled"] == 0.0 and m["seal/apatch/enabled"] == 1.0


ROWS = [
    ["pass", "correct_abstention", "pass"],
    ["spurious_tool_call", "spurious_tool_call"],
    ["instance_mismatch"],
    ["checker_error", "gt_error"],  # tagged, but nothing effective → 1.0
    ["checker_error", "spurious_tool_call"],  # excluded tag ignored → 2.0
    None,  # no tags → 1.0, missing
    [],  # no tags → 1.0, missing
    ["brand_new", "response_mismatch"],  # unknown tag weighs 1.0
]


def test_scales_clip_exclusions_missing_rows():
    c = static_cfg(min_scale=0.7, max_scale=1.9, tag_weights={"spurious_tool_call": 2.5})
    w = resolve_weights(c)
    want = [ref_scale(r, w, 0.7, 1.9) for r in ROWS]
    assert per_row_scales(ROWS, w, 0.7, 1.9) == pytest.approx(want)
    assert want[1] == 1.9 and want[2] == 0.7 and want[3] == 1.0 and want[4] == 1.9 and want[5] == want[6] == 1.0
    assert want[7] == pytest.approx(0.95)
    adv = torch.linspace(-1, 1, len(ROWS) * 3).view(len(ROWS), 3)
    out, m = apply_apatch(adv, ROWS, c, global_step=3)
    assert torch.allclose(out, torch.tensor(ref_apply(adv.tolist(), want, "all")))
    assert m["seal/apatch/scaled_count"] == 6.0 and m["seal/apatch/missing_tag_count"] == 2.0
    tagged = [want[i] for i, r in enumerate(ROWS) if r]
    assert m["seal/apatch/mean_scale"] == pytest.approx(sum(tagged) / len(tagged))
    n_occ = sum(len(r) for r in ROWS if r)
    assert m["seal/apatch/tag_frac/checker_error"] == pytest.approx(2 / n_occ)  # excluded tags still counted


def test_scale_distribution_is_logged_over_tagged_rows():
    c = static_cfg(min_scale=0.7, max_scale=1.9, tag_weights={"spurious_tool_call": 2.5})
    w = resolve_weights(c)
    tagged = sorted(ref_scale(r, w, 0.7, 1.9) for r in ROWS if r)
    _, m = apply_apatch(torch.zeros(len(ROWS), 2), ROWS, c, global_step=3)
    assert m["seal/apatch/scale/min"] == pytest.approx(tagged[0])
    assert m["seal/apatch/scale/max"] == pytest.approx(tagged[-1])
    assert m["seal/apatch/scale/p50"] == pytest.approx(float(np.median(tagged)))
    assert m["seal/apatch/scale/p25"] == pytest.approx(float(np.percentile(tagged, 25)))


@pytest.mark.parametrize("mode", ["all", "positive_advantage", "negative_advantage"])
def test_apply_to_modes(mode):
    rows = [["spurious_tool_call"], ["instance_mismatch"], ["pass", "correct_abstention", "pass"]]
    adv = torch.tensor([[1.0, -2.0, 0.0, 3.0], [-1.0, 0.5, 0.0, -0.25], [0.0, 2.0, -2.0, 1.0]])
    out, _ = apply_apatch(adv, rows, static_cfg(apply_to=mode), global_step=1)
    w = dict(UPSTREAM)
    scales = [ref_scale(r, w, 0.5, 2.0) for r in rows]
    assert torch.allclose(out, torch.tensor(ref_apply(adv.tolist(), scales, mode)))


def test_warmup_skips_scaling_and_weight_update():
    state = CapabilityState()
    state.observe("c", "t", 0.0, False, ["response_mismatch"] * 10, 0, 1)
    adv = torch.tensor([[1.0, -1.0]])
    c = cfg(warmup_steps=3)
    out, m = apply_apatch(adv, [["spurious_tool_call"]], c, global_step=2, state=state)
    assert torch.equal(out, adv)
    assert m == {"seal/apatch/enabled": 1.0, "seal/apatch/warmup_skipped": 1.0, "seal/apatch/scaled_count": 0.0}
    assert state.dynamic_tag_weights == {}
    out, m = apply_apatch(adv, [["spurious_tool_call"]], c, global_step=3, state=state)
    assert m["seal/apatch/warmup_skipped"] == 0.0 and state.dynamic_tag_weights
    assert not torch.equal(out, adv)


def test_disabled_is_identity():
    adv = torch.randn(4, 5)
    out, m = apply_apatch(adv, [["spurious_tool_call"]] * 4, APatchConfig(), global_step=1)
    assert torch.equal(out, adv) and m == {"seal/apatch/enabled": 0.0}


def test_budget_exact():
    rows = [
        ["spurious_tool_call"],
        ["instance_mismatch"],
        ["pass", "correct_abstention", "pass"],
        None,
        ["response_mismatch"],
    ]
    c = static_cfg(budget={"enable": True, "strength": 0.5, "min_scale": 0.8, "max_scale": 1.4, "target_mean": 1.0})
    pre = [ref_scale(r, UPSTREAM, 0.5, 2.0) for r in rows]
    tagged = [i for i, r in enumerate(rows) if r]
    post = ref_budget(pre, tagged, 0.5, 0.8, 1.4, 1.0)
    adv = torch.ones(len(rows), 2)
    out, m = apply_apatch(adv, rows, c, global_step=1)
    assert out[:, 0].tolist() == pytest.approx(post)
    assert post[3] == 1.0  # untagged rows are not part of the budget
    assert m["seal/apatch/budget_enabled"] == 1.0
    assert m["seal/apatch/budget_mean_before"] == pytest.approx(sum(pre[i] for i in tagged) / len(tagged))
    assert m["seal/apatch/budget_mean_after"] == pytest.approx(sum(post[i] for i in tagged) / len(tagged))
    assert m["seal/apatch/mean_scale"] == m["seal/apatch/budget_mean_before"]  # pre-budget mean
    # budget bounds default to the A-Patch bounds; no target_mean → no renormalisation
    c2 = static_cfg(budget={"enable": True, "strength": 2.0})
    out2, _ = apply_apatch(adv, rows, c2, global_step=1)
    assert out2[:, 0].tolist() == pytest.approx(ref_budget(pre, tagged, 2.0, 0.5, 2.0, None))


# ------------------------------------------------------------------ independent reference: the closed loop
def ref_tag_counts(observations):
    """observations: list of (reward, tags). Every tag occurrence counts; [] → ['unknown']."""
    counts, reward_sums = {}, {}
    for reward, tags in observations:
        for t in tags or ["unknown"]:
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


def closed_loop_step(state, lo=0.5, hi=2.0, beta=0.25, alpha=1.0, C=32):
    """One training step's closed-loop update, run by apply_apatch; returns the weights that step used."""
    c = cfg(min_scale=lo, max_scale=hi, dynamic={"ema_beta": beta, "prevalence_alpha": alpha, "confidence_samples": C})
    _, m = apply_apatch(torch.zeros(1, 1), [["pass"]], c, global_step=1, state=state)
    prefix = "seal/apatch/tag_weight/"
    return {k[len(prefix) :]: v for k, v in m.items() if k.startswith(prefix)}


def _batch(rng, n):
    vocab = [
        "pass",
        "pass",
        "pass",
        "correct_abstention",
        "spurious_tool_call",
        "state_mismatch",
        "response_mismatch",
        "empty_turn_model_response",
        "instance_mismatch",
        "checker_error",
        "gt_error",
        "brand_new_tag",
    ]
    out = []
    for _ in range(n):
        k = rng.randint(0, 6)  # 0 → no tags → unknown
        tags = [rng.choice(vocab) for _ in range(k)]
        reward = 1.0 if tags and all(t in ("pass", "correct_abstention") for t in tags) else 0.0
        out.append((reward, tags))
    return out


def test_dynamic_weights_over_consecutive_steps_with_windows_and_totals():
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
            got = closed_loop_step(s, lo, hi, beta, alpha, C)
            want, prev = ref_update(window, total, UPSTREAM, prev, lo, hi, beta, alpha, C)
            assert_weights_equal(got, want)
            assert_weights_equal(s.dynamic_tag_weights, prev)
        # epoch end: window reset; an update before the next observation uses the totals
        s.reset_window()
        window = []
        got = closed_loop_step(s, lo, hi, beta, alpha, C)
        want, prev = ref_update(window, total, UPSTREAM, prev, lo, hi, beta, alpha, C)
        assert_weights_equal(got, want)
    # the excluded tags are present and pinned toward 1.0, new tags appear with base 1.0
    assert "checker_error" in prev and "brand_new_tag" in prev and "unknown" in prev


def test_dynamic_small_example_by_hand():
    s = CapabilityState()
    # 2 trajectories: [spurious, pass] r=0 ; [pass] r=1 ; [checker_error] r=0
    s.observe("c", "a", 0.0, False, ["spurious_tool_call", "pass"], 0, 1)
    s.observe("c", "b", 1.0, True, ["pass"], 0, 1)
    s.observe("c", "c", 0.0, False, ["checker_error"], 0, 1)
    w = closed_loop_step(s, 0.5, 2.0, 0.25, 1.0, 2)
    # N = 3 (checker_error excluded); spurious: count 1, mean 0 → 2.0*(1+1*(1/3)*1*min(1,1/2)) = 2.333 → clamp 2.0
    assert w["spurious_tool_call"] == pytest.approx(0.75 * 2.0 + 0.25 * 2.0)
    assert w["pass"] == pytest.approx(1.0)
    assert w["checker_error"] == pytest.approx(1.0)
    # tag unseen in source: target = base → stays at base
    assert w["instance_mismatch"] == pytest.approx(0.6)
    # with a lower base the prevalence boost shows: response_mismatch seen once, mean 0
    s2 = CapabilityState()
    s2.observe("c", "a", 0.0, False, ["response_mismatch", "pass", "pass", "pass"], 0, 1)
    w2 = closed_loop_step(s2, 0.5, 2.0, 0.5, 1.0, 4)
    target = 0.9 * (1 + 1.0 * 0.25 * 1.0 * 0.25)
    assert w2["response_mismatch"] == pytest.approx(0.5 * 0.9 + 0.5 * target)


def test_dynamic_only_excluded_tags_returns_base_and_stores_nothing():
    s = CapabilityState()
    s.observe("c", "a", 0.0, False, ["checker_error", "gt_error"], 0, 1)
    assert closed_loop_step(s) == UPSTREAM
    assert s.dynamic_tag_weights == {}
    assert dynamic_weights(UPSTREAM, {}, s.tag_evidence(), cfg()) is None


def test_dynamic_zero_beta_and_zero_alpha_are_respected():
    s = CapabilityState()
    s.observe("c", "a", 0.0, False, ["response_mismatch"] * 40, 0, 1)
    assert closed_loop_step(s, 0.5, 2.0, 0.0, 1.0, 32)["response_mismatch"] == 0.9
    assert closed_loop_step(s, 0.5, 2.0, 1.0, 0.0, 32)["response_mismatch"] == pytest.approx(0.9)
    # confidence_samples 0 behaves as 1 (full confidence), no division by zero
    w = CapabilityState()
    w.observe("c", "a", 0.0, False, ["response_mismatch", "pass"], 0, 1)
    assert closed_loop_step(w, 0.5, 2.0, 1.0, 1.0, 0)["response_mismatch"] == pytest.approx(0.9 * 1.5)


def test_dynamic_rejects_bad_beta():
    with pytest.raises(ValueError, match="ema_beta"):
        closed_loop_step(CapabilityState(), 0.5, 2.0, 1.5, 1.0, 32)


def test_dynamic_update_happens_first_and_is_used():
    state = CapabilityState()
    obs = [(0.0, ["response_mismatch", "pass"]), (0.0, ["spurious_tool_call"]), (1.0, ["pass", "pass"])]
    for r, t in obs:
        state.observe("c", "t", r, r >= 1, t, 0, 1)
    c = cfg(dynamic={"ema_beta": 0.5, "prevalence_alpha": 2.0, "confidence_samples": 2})
    rows = [["response_mismatch", "pass"], ["spurious_tool_call"], ["pass", "pass"]]
    adv = torch.tensor([[-1.0], [-1.0], [2.0]])
    out, m = apply_apatch(adv, rows, c, global_step=1, state=state)
    weights, _ = ref_update(obs, obs, UPSTREAM, {}, 0.5, 2.0, 0.5, 2.0, 2)
    assert weights["response_mismatch"] != UPSTREAM["response_mismatch"]  # the update did something
    want = [ref_scale(r, weights, 0.5, 2.0) for r in rows]
    assert out[:, 0].tolist() == pytest.approx([row[0] for row in ref_apply(adv.tolist(), want, "all")])
    assert m["seal/apatch/dynamic_enabled"] == 1.0
    for t, w in weights.items():
        assert m[f"seal/apatch/tag_weight/{t}"] == pytest.approx(w)
    # no state → static weights even though dynamic.enable is true
    _, m2 = apply_apatch(adv, rows, c, global_step=1, state=None)
    assert m2["seal/apatch/dynamic_enabled"] == 0.0 and m2["seal/apatch/tag_weight/response_mismatch"] == 0.9


def test_grpo_zero_rows_stay_zero():
    adv = torch.zeros(8, 6)
    rows = [["spurious_tool_call"]] * 4 + [["pass", "correct_abstention"]] * 4
    for mode in ("all", "positive_advantage", "negative_advantage"):
        out, _ = apply_apatch(adv, rows, static_cfg(apply_to=mode), global_step=1)
        assert torch.count_nonzero(out) == 0


def test_sign_preserved_randomised():
    rng = random.Random(20240607)
    torch.manual_seed(7)
    vocab = list(UPSTREAM) + ["checker_error", "gt_error", "unknown", "weird"]
    for trial in range(60):
        b, r = rng.randint(1, 24), rng.randint(1, 9)
        adv = torch.randn(b, r) * rng.choice([1e-6, 1.0, 100.0])
        adv[torch.rand(b, r) < 0.2] = 0.0
        rows = [None if rng.random() < 0.1 else [rng.choice(vocab) for _ in range(rng.randint(0, 8))] for _ in range(b)]
        lo = rng.uniform(0.01, 1.0)
        c = cfg(
            min_scale=lo,
            max_scale=lo + rng.uniform(0.0, 3.0),
            apply_to=rng.choice(["all", "positive_advantage", "negative_advantage"]),
            tag_weights={t: rng.uniform(0.0, 5.0) for t in vocab},
            budget={
                "enable": rng.random() < 0.5,
                "strength": rng.uniform(0, 3),
                "target_mean": rng.choice([None, 0.7, 1.0, 1.5]),
            },
        )
        state = CapabilityState()
        for row in rows:
            state.observe("c", "t", float(rng.random() < 0.3), False, row, 0, trial)
        out, _ = apply_apatch(adv, rows, c, global_step=trial, state=state)
        assert torch.equal(torch.sign(out), torch.sign(adv)), trial


def test_composes_with_verl_grpo():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rng = random.Random(3)
    n_tasks, n_roll, L = 4, 8, 12
    b = n_tasks * n_roll
    lengths = [rng.randint(1, L) for _ in range(b)]
    mask = torch.zeros(b, L)
    rewards = torch.zeros(b, L)
    scores = []
    for i in range(b):
        mask[i, : lengths[i]] = 1
        s = float(rng.random() < 0.4) if i // n_roll != 2 else 1.0  # task 2: all pass → GRPO zero
        scores.append(s)
        rewards[i, lengths[i] - 1] = s
    index = np.array([f"uid{i // n_roll}" for i in range(b)], dtype=object)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=True)
    assert torch.equal(adv, ret)

    vocab = list(UPSTREAM) + ["checker_error"]
    rows = [[rng.choice(vocab) for _ in range(rng.randint(1, 8))] for _ in range(b)]
    out, _ = apply_apatch(adv, rows, static_cfg(), global_step=1)

    # independent: GRPO as verl defines it (Bessel std, eps 1e-6), then the A-Patch scale
    for i in range(b):
        group = [scores[j] for j in range(b) if j // n_roll == i // n_roll]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        a = (scores[i] - mean) / (std + 1e-6)
        s = ref_scale(rows[i], UPSTREAM, 0.5, 2.0)
        for t in range(L):
            assert out[i, t].item() == pytest.approx(a * s * mask[i, t].item(), abs=1e-5)
    assert torch.count_nonzero(out[2 * n_roll : 3 * n_roll]) == 0


# ------------------------------------------------------------------ config
def test_zero_values_are_not_replaced_by_defaults():
    c = cfg(
        warmup_steps=0,
        dynamic={"ema_beta": 0.0, "prevalence_alpha": 0.0, "confidence_samples": 0},
        budget={"enable": True, "strength": 0.0},
        tag_weights={"pass": 0.0},
    )
    assert (c.dynamic.ema_beta, c.dynamic.prevalence_alpha, c.dynamic.confidence_samples) == (0.0, 0.0, 0)
    assert c.budget.strength == 0.0 and c.tag_weights["pass"] == 0.0 and c.warmup_steps == 0
    # ema_beta 0 → weights never move, even with an overwhelming failure profile
    state = CapabilityState()
    state.observe("c", "t", 0.0, False, ["response_mismatch"] * 50, 0, 1)
    _, m = apply_apatch(torch.ones(1, 1), [["response_mismatch"]], c, global_step=1, state=state)
    assert m["seal/apatch/tag_weight/response_mismatch"] == 0.9
    # strength 0 → every tagged row gets exactly 1
    out, _ = apply_apatch(torch.ones(2, 1), [["spurious_tool_call"], ["pass"]], c, global_step=1)
    assert out.flatten().tolist() == [1.0, 1.0]
    # empty exclusion list is respected: checker_error then weighs 1.0 like any unknown tag
    c2 = static_cfg(excluded_tags=[], tag_weights={"checker_error": 2.0})
    out, _ = apply_apatch(torch.ones(1, 1), [["checker_error"]], c2, global_step=1)
    assert out.item() == 2.0


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"apply_to": "positive"}, "apply_to"),
        ({"vocabulary": "labels"}, "vocabulary"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"min_scale": 3.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"enable": "yes"}, "enable"),
        ({"bogus": 1}, "unknown config key"),
        ({"dynamic": {"ema_beta": 1.5}}, "ema_beta"),
        ({"dynamic": {"emabeta": 0.1}}, "unknown config key.*apatch.dynamic"),
        ({"dynamic": {"confidence_samples": -2}}, "confidence_samples"),
        ({"budget": {"strength": -1}}, "strength"),
        ({"budget": {"min_scale": 1.5, "max_scale": 1.2}}, "budget.min_scale"),
        ({"budget": {"normalize_mean": True}}, "unknown config key.*apatch.budget"),
        ({"tag_weights": {"pass": -0.1}}, "tag_weights.pass"),
        ({"tag_weights": {"pass": "high"}}, "tag_weights.pass"),
        ({"excluded_tags": "checker_error"}, "excluded_tags"),
        ({"metric_prefix": ""}, "metric_prefix"),
    ],
)
def test_bad_config_raises_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        APatchConfig.from_dict(bad)


def test_from_omegaconf_and_new_tags():
    raw = OmegaConf.create({"enable": True, "tag_weights": {"pass": 1.1, "my_tag": 3.0}, "dynamic": None})
    c = APatchConfig.from_dict(raw)
    assert c.tag_weights["my_tag"] == 3.0 and c.tag_weights["pass"] == 1.1
    assert c.tag_weights["spurious_tool_call"] == 2.0 and c.dynamic.enable is True


def test_paper_label_vocabulary():
    c = static_cfg(vocabulary="paper_labels", label_weights={"recovery_failure": 1.4})
    w = resolve_weights(c)
    assert w == {**DEFAULT_LABEL_WEIGHTS, "recovery_failure": 1.4}
    out, m = apply_apatch(torch.ones(1, 1), [["invalid_tool_call", "pass"]], c, global_step=1)
    assert out.item() == pytest.approx((2.0 + 1.0) / 2)
    assert "seal/apatch/tag_weight/invalid_tool_call" in m


def test_row_count_mismatch_and_string_rows_rejected():
    with pytest.raises(ValueError, match="rows"):
        apply_apatch(torch.ones(2, 1), [["pass"]], static_cfg(), global_step=1)
    with pytest.raises(TypeError):
        apply_apatch(torch.ones(1, 1), ["pass"], static_cfg(), global_step=1)


def test_custom_metric_prefix():
    _, m = apply_apatch(torch.ones(1, 1), [["pass"]], static_cfg(metric_prefix="tocf/apatch"), global_step=1)
    assert m["tocf/apatch/enabled"] == 1.0 and not any(k.startswith("seal/") for k in m)
