"""Figures (PNG) of one run or several: held-out accuracy per category over steps with standard-error bands
(the paper's Figure 3), failure-tag shares and A-Patch weights over steps, and the A-Patch scale distribution
per step.

Single series over steps reuse ``seal.diagnostics.plot_over_steps``; what it cannot draw (bands, one panel per
category, several runs) is here. Every function draws on its own Agg canvas (no global matplotlib state) and
returns the path written, or None when the run logged nothing to draw.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from seal.apatch import APatchConfig
from seal.diagnostics import integer_steps, plot_over_steps

PANELS = ("average", "base", "miss_func", "miss_param", "long_context")
#: Where A-Patch's metrics are logged unless the recipe says otherwise (``seal.apatch.metric_prefix``).
APATCH = APatchConfig.metric_prefix


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def accuracy_bands(runs: Mapping[str, Mapping[int, Mapping]], path: str) -> str | None:
    """One panel per category (and the average): accuracy (%) over steps per run, shaded ± one standard error.
    ``runs[name][step][column]`` is a ``seal.results.tables.Cell``."""
    if not any(runs.values()):
        return None
    fig = _figure(4.0 * len(PANELS), 3.6)
    for i, column in enumerate(PANELS):
        ax = fig.add_subplot(1, len(PANELS), i + 1)
        for name, history in runs.items():
            points = [(s, h[column]) for s, h in sorted(history.items()) if column in h]
            if not points:
                continue
            steps = [s for s, _ in points]
            acc = [100 * c.accuracy for _, c in points]
            se = [100 * c.stderr if not math.isnan(c.stderr) else 0.0 for _, c in points]
            line = ax.errorbar(steps, acc, yerr=se, marker="o", markersize=3, capsize=2, label=name).lines[0]
            ax.fill_between(
                steps,
                [a - e for a, e in zip(acc, se)],
                [a + e for a, e in zip(acc, se)],
                color=line.get_color(),
                alpha=0.2,
                linewidth=0,
            )
        ax.set_title(column.replace("_", " "))
        ax.set_xlabel("global step")
        integer_steps(ax)
        if i == 0:
            ax.set_ylabel("held-out accuracy (%)")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    if handles:
        fig.axes[-1].legend(handles, labels, fontsize=7, loc="lower right")
    return _save(fig, path)


def _series(metrics: Mapping[int, Mapping[str, float]], prefix: str) -> dict[int, dict[str, float]]:
    out = {}
    for step, data in metrics.items():
        values = {k[len(prefix) :]: float(v) for k, v in data.items() if k.startswith(prefix)}
        if values:
            out[int(step)] = values
    return out


def tag_shares(metrics: Mapping[int, Mapping[str, float]], path: str, prefix: str = APATCH) -> str | None:
    """Share of each failure tag among the step's tagged turns (``<prefix>/tag_frac/<tag>``)."""
    history = _series(metrics, f"{prefix}/tag_frac/")
    if not history:
        return None
    return plot_over_steps(history, path, title="failure-tag shares per step", ylabel="share of turns", reference=None)


def apatch_weights(metrics: Mapping[int, Mapping[str, float]], path: str, prefix: str = APATCH) -> str | None:
    """The weight of each tag A-Patch used per step (``<prefix>/tag_weight/<tag>``)."""
    history = _series(metrics, f"{prefix}/tag_weight/")
    if not history:
        return None
    return plot_over_steps(history, path, title="A-Patch tag weights per step", ylabel="weight")


def label_shares(epoch_dumps: Mapping[int, Mapping], path: str) -> str | None:
    """Share of each paper label per epoch, from the per-epoch diagnostic dumps (``diagnostic_stats/epoch_<e>.json``:
    ``labels`` = {label: {"count": n, ...}}), drawn at each dump's global step."""
    history = {}
    for dump in epoch_dumps.values():
        counts = {k: float(v.get("count", 0)) for k, v in (dump.get("labels") or {}).items()}
        total = sum(counts.values())
        if total and dump.get("global_step") is not None:
            history[int(dump["global_step"])] = {k: v / total for k, v in counts.items()}
    if not history:
        return None
    return plot_over_steps(history, path, title="paper-label shares per epoch", ylabel="share of turns", reference=None)


#: The nested quantile bands of ``apatch_scales``, outermost first: (low, high, opacity).
SCALE_BANDS = (("min", "max", 0.12), ("p10", "p90", 0.2), ("p25", "p75", 0.3))
#: Half the width of a one-step band (a band over a single step has no width of its own).
ONE_STEP_HALF_WIDTH = 0.3


def scale_bands(
    metrics: Mapping[int, Mapping[str, float]], steps: list[int], prefix: str = APATCH
) -> list[tuple[str, list, list, list]]:
    """The quantile bands that would show: (label, steps, low, high) over the steps that logged both quantiles.
    A band of no height anywhere is left out, and a band equal to the next narrower one (which would hide it) is
    merged into it, so the legend names only what is visible."""
    bands = []
    for low, high, _ in SCALE_BANDS:
        keys = (f"{prefix}/scale/{low}", f"{prefix}/scale/{high}")
        at = [s for s in steps if all(k in metrics[s] for k in keys)]
        lows, highs = [float(metrics[s][keys[0]]) for s in at], [float(metrics[s][keys[1]]) for s in at]
        if not at or all(h <= lo for lo, h in zip(lows, highs)):
            bands.append(None)
            continue
        if bands and bands[-1] is not None and bands[-1][1:] == (at, lows, highs):
            outer = bands.pop()
            bands.append((f"{outer[0]} = {low}–{high}", at, lows, highs))
            continue
        bands.append((f"{low}–{high}", at, lows, highs))
    return [b for b in bands if b is not None]


def _one_step_wide(steps: list[int], *series: list[float]) -> tuple[list[float], ...]:
    """A single step drawn as a short span around it, so that a band over it has an area."""
    if len(steps) != 1:
        return (steps, *series)
    return ([steps[0] - ONE_STEP_HALF_WIDTH, steps[0] + ONE_STEP_HALF_WIDTH], *[v * 2 for v in series])


def apatch_scales(metrics: Mapping[int, Mapping[str, float]], path: str, prefix: str = APATCH) -> str | None:
    """The distribution of A-Patch scales per step: nested quantile bands and the median where the trainer logged
    ``<prefix>/scale/<quantile>``; the mean scale (``<prefix>/mean_scale``) always."""
    steps = sorted(s for s, d in metrics.items() if f"{prefix}/mean_scale" in d)
    if not steps:
        return None
    fig = _figure(8, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    alphas = {f"{low}–{high}": alpha for low, high, alpha in SCALE_BANDS}
    for label, at, lows, highs in scale_bands(metrics, steps, prefix):
        x, lows, highs = _one_step_wide(at, lows, highs)
        alpha = alphas[label.rsplit(" = ", 1)[-1]]  # a merged band is drawn as the narrower one it equals
        ax.fill_between(x, lows, highs, color="tab:blue", alpha=alpha, linewidth=0, label=label)
    median = [s for s in steps if f"{prefix}/scale/p50" in metrics[s]]
    if median:
        values = [metrics[s][f"{prefix}/scale/p50"] for s in median]
        ax.plot(median, values, color="tab:blue", marker="s", markersize=3, label="median")
    ax.plot(
        steps,
        [metrics[s][f"{prefix}/mean_scale"] for s in steps],
        color="black",
        marker="o",
        markersize=3,
        label="mean",
    )
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    integer_steps(ax)
    ax.set_xlabel("global step")
    ax.set_ylabel("advantage scale")
    ax.set_title("A-Patch scales per step")
    ax.legend(fontsize=7)
    return _save(fig, path)


def reward_over_steps(
    runs: Mapping[str, Mapping[int, tuple[float, float]]],
    path: str,
    ylabel: str = "mean episode reward",
    title: str = "training reward per step (± one standard error)",
    ylim: tuple[float, float] | None = (-0.05, 1.05),
    zero_line: bool = False,
) -> str | None:
    """Training reward (or any per-step mean) over steps for several runs: ``runs[name][step] = (mean, se)``,
    drawn as a line with a ± one standard error band. ``ylim`` None: the data's range; ``zero_line``: a line at 0
    (for differences)."""
    if not any(runs.values()):
        return None
    fig = _figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for name, per_step in runs.items():
        steps = sorted(per_step)
        mean = [per_step[s][0] for s in steps]
        se = [per_step[s][1] for s in steps]
        line = ax.plot(steps, mean, marker="o", markersize=3, label=name)[0]
        low, high = [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)]
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    integer_steps(ax)
    ax.set_xlabel("global step")
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    if zero_line:
        ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def run_figures(run_dir: str, out_dir: str | None = None, apatch_prefix: str = APATCH) -> list[str]:
    """Every single-run figure of a training run, written to ``out_dir`` (default: the run directory);
    ``apatch_prefix``: where the run logged A-Patch's metrics (its recipe's ``seal.apatch.metric_prefix``)."""
    import glob
    import json

    from seal.results.runs import load_run, read_metrics

    out_dir = out_dir or run_dir
    metrics = read_metrics(run_dir)
    dumps = {}
    for p in glob.glob(os.path.join(run_dir, "diagnostic_stats", "epoch_*.json")):
        with open(p) as f:
            dumps[int(os.path.basename(p)[len("epoch_") : -len(".json")])] = json.load(f)
    written = [
        tag_shares(metrics, os.path.join(out_dir, "tag_shares.png"), apatch_prefix),
        apatch_weights(metrics, os.path.join(out_dir, "apatch_weights.png"), apatch_prefix),
        apatch_scales(metrics, os.path.join(out_dir, "apatch_scales.png"), apatch_prefix),
        label_shares(dumps, os.path.join(out_dir, "label_shares.png")),
    ]
    try:
        run = load_run(run_dir)
        written.append(accuracy_bands({run.name: run.history}, os.path.join(out_dir, "accuracy_bands.png")))
    except FileNotFoundError:
        pass  # no validation logged yet
    return [p for p in written if p]
