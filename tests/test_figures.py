"""Figures from a run's logged metrics: files written when there is data, nothing when there is none."""

from __future__ import annotations

import json

from seal import figures
from seal.eval.report import binomial_cell


def metrics(steps=4, quantiles=True):
    out = {}
    for s in range(1, steps + 1):
        data = {
            "seal/apatch/mean_scale": 1.0 + 0.1 * s,
            "seal/apatch/tag_frac/state_mismatch": 0.5 - 0.05 * s,
            "seal/apatch/tag_frac/pass": 0.5 + 0.05 * s,
            "seal/apatch/tag_weight/state_mismatch": 1.0 + 0.1 * s,
        }
        if quantiles:
            data.update(
                {f"seal/apatch/scale/{q}": 0.5 + 0.2 * i + 0.01 * s for i, q in enumerate(figures.SCALE_QUANTILES)}
            )
        out[s] = data
    return out


def test_each_figure_is_written_from_its_metrics(tmp_path):
    m = metrics()
    drawn = ((figures.tag_shares, "t.png"), (figures.apatch_weights, "w.png"), (figures.apatch_scales, "s.png"))
    for fn, name in drawn:
        path = fn(m, str(tmp_path / name))
        assert path and (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert figures.tag_shares({1: {"other": 1.0}}, str(tmp_path / "none.png")) is None
    assert not (tmp_path / "none.png").exists()


def test_scale_quantile_bands_change_the_picture(tmp_path):
    with_q = figures.apatch_scales(metrics(quantiles=True), str(tmp_path / "q.png"))
    without = figures.apatch_scales(metrics(quantiles=False), str(tmp_path / "m.png"))
    assert open(with_q, "rb").read() != open(without, "rb").read()


def test_accuracy_bands_for_several_runs(tmp_path):
    history = {s: {c: binomial_cell(10 + 5 * s, 100) for c in figures.PANELS} for s in (0, 5, 10)}
    path = figures.accuracy_bands({"a": history, "b": {0: history[0]}}, str(tmp_path / "acc.png"))
    assert path and (tmp_path / "acc.png").stat().st_size > 10_000
    assert figures.accuracy_bands({"a": {}}, str(tmp_path / "empty.png")) is None


def test_run_figures_from_a_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "diagnostic_stats").mkdir(parents=True)
    with open(run / "metrics_1.jsonl", "w") as f:
        for step, data in metrics().items():
            data["val-core/multi_turn_base/reward/mean@1"] = 0.1 * step
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    (run / "diagnostic_stats" / "epoch_0.json").write_text(
        json.dumps({"global_step": 4, "labels": {"pass": {"count": 3}, "state_mismatch": {"count": 1}}})
    )
    written = figures.run_figures(str(run))
    assert {p.rsplit("/", 1)[1] for p in written} == {
        "tag_shares.png",
        "apatch_weights.png",
        "apatch_scales.png",
        "label_shares.png",
        "accuracy_bands.png",
    }


def test_reward_over_steps_draws_each_run_with_its_band(tmp_path):
    runs = {"normal": {1: (0.25, 0.1), 2: (0.6, 0.1), 3: (0.9, 0.05)}, "flipped": {1: (0.25, 0.1), 2: (0.1, 0.05)}}
    path = figures.reward_over_steps(runs, str(tmp_path / "r.png"))
    assert path and (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    one = figures.reward_over_steps({"normal": runs["normal"]}, str(tmp_path / "one.png"))
    assert (tmp_path / "one.png").read_bytes() != (tmp_path / "r.png").read_bytes() and one
    assert figures.reward_over_steps({"normal": {}}, str(tmp_path / "none.png")) is None
    assert not (tmp_path / "none.png").exists()
