"""Figures from a run's logged metrics: files written when there is data, nothing when there is none."""

from __future__ import annotations

import json

import pytest
from matplotlib.figure import Figure

from seal.apatch import SCALE_QUANTILES
from seal.results import figures
from seal.results.tables import binomial_cell


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
            data.update({f"seal/apatch/scale/{q}": 0.5 + 0.2 * i + 0.01 * s for i, q in enumerate(SCALE_QUANTILES)})
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


@pytest.fixture
def drawn(monkeypatch):
    """Every matplotlib figure saved during the test, to read what was drawn (the PNG says nothing legible)."""
    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), real(fig, *a, **k))[1])
    return saved


def visible_ticks(ax) -> list[float]:
    low, high = ax.get_xlim()
    return [t for t in ax.get_xticks() if low <= t <= high]


def one_step(step=1, scales=(0.8, 0.9, 1.2, 1.5, 1.6, 1.8, 2.0)):
    data = {f"seal/apatch/scale/{q}": v for q, v in zip(SCALE_QUANTILES, scales)}
    return {step: {**data, "seal/apatch/mean_scale": 1.4, "seal/apatch/tag_frac/pass": 1.0}}


@pytest.mark.parametrize("plot", [figures.apatch_scales, figures.tag_shares])
def test_a_one_step_run_gets_integer_step_ticks(tmp_path, drawn, plot):
    plot(one_step(step=3), str(tmp_path / "f.png"))
    ticks = visible_ticks(drawn[-1].axes[0])
    assert ticks == [3.0]


def test_accuracy_bands_tick_integer_steps_only(tmp_path, drawn):
    figures.accuracy_bands({"a": {2: {c: binomial_cell(3, 10) for c in figures.PANELS}}}, str(tmp_path / "a.png"))
    for ax in drawn[-1].axes:
        assert visible_ticks(ax) and all(t == int(t) for t in visible_ticks(ax))


def legend_names(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def band_areas(ax) -> dict[str, float]:
    """Label -> area of the filled band."""
    areas = {}
    for band in ax.collections:
        extent = band.get_paths()[0].get_extents()
        areas[band.get_label()] = extent.width * extent.height
    return areas


def test_a_one_step_runs_scale_bands_are_drawn_with_an_area(tmp_path, drawn):
    figures.apatch_scales(one_step(), str(tmp_path / "s.png"))
    ax = drawn[-1].axes[0]
    assert legend_names(ax) == ["min–max", "p10–p90", "p25–p75", "median", "mean"]
    assert all(area > 0 for area in band_areas(ax).values())
    median = next(line for line in ax.get_lines() if line.get_label() == "median")
    assert median.get_marker() not in (None, "None", "")  # a single point without a marker is not drawn


def test_the_legend_names_only_the_bands_that_show(tmp_path, drawn):
    # every tagged trajectory got the same scale: the bands have no height
    figures.apatch_scales(one_step(scales=(1.5,) * 7), str(tmp_path / "flat.png"))
    assert legend_names(drawn[-1].axes[0]) == ["median", "mean"]
    # min and p10, max and p90 coincide: the outer band lies entirely under the inner one, one entry names both
    figures.apatch_scales(one_step(scales=(1.0, 1.0, 1.2, 1.5, 1.8, 2.0, 2.0)), str(tmp_path / "two.png"))
    ax = drawn[-1].axes[0]
    assert legend_names(ax) == ["min–max = p10–p90", "p25–p75", "median", "mean"]
    assert all(area > 0 for area in band_areas(ax).values())


def test_bands_cover_the_steps_that_logged_quantiles(tmp_path, drawn):
    m = metrics(steps=3)
    for key in [k for k in m[2] if k.startswith("seal/apatch/scale/")]:
        del m[2][key]  # a step without a tagged trajectory logs no quantiles
    figures.apatch_scales(m, str(tmp_path / "s.png"))
    ax = drawn[-1].axes[0]
    assert "min–max" in legend_names(ax)
    band = next(b for b in ax.collections if b.get_label() == "min–max")
    assert sorted({round(x) for x in band.get_paths()[0].vertices[:, 0]}) == [1, 3]


def test_a_recipe_that_logs_apatch_elsewhere_gets_its_apatch_figures_from_there(tmp_path):
    """``seal.apatch.metric_prefix`` is a recipe key: the figures read A-Patch's metrics where the run logged them
    (before, always under ``seal/apatch``: a run with another prefix got no A-Patch figures)."""
    moved = {s: {k.replace("seal/apatch/", "runs/b/apatch/"): v for k, v in d.items()} for s, d in metrics().items()}
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics_1.jsonl", "w") as f:
        for step, data in moved.items():
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    apatch = {"tag_shares.png", "apatch_weights.png", "apatch_scales.png"}
    assert not apatch & {p.rsplit("/", 1)[1] for p in figures.run_figures(str(run), str(tmp_path / "default"))}
    written = figures.run_figures(str(run), str(tmp_path / "moved"), apatch_prefix="runs/b/apatch")
    assert apatch <= {p.rsplit("/", 1)[1] for p in written}
