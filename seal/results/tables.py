"""The paper's table and the failure profile from a results file.

Accuracy per category is passes / episodes with the binomial standard error sqrt(p(1-p)/n); the paper's
Average is the mean of the four category accuracies (= passes / 400 on the balanced held-out set), whose standard
error is sqrt(sum of the categories' squared errors) / number of categories (categories are independent samples).
Where fewer than 5 episodes passed or fewer than 5 failed, the normal approximation behind ``± se`` fails (0/2
would read ``0.00 ± 0.00``): such a cell shows its 95 % Wilson score interval instead (of the pooled count, for an
Average whose categories are of equal size), and where it is combined (an average, a difference) its Wilson
half-width / z stands in for its SE. An Average of categories of unequal size is not the pooled share, so it shows
``± se`` around the mean it prints. An Average over fewer categories than the table's is marked with how many it
covers.
Episodes the environment could not run are counted apart and left out, as in training validation.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import Counter
from dataclasses import asdict, dataclass

from env_service.bfcl.ood_tasks import OOD_CATEGORIES
from env_service.vocabulary import CATEGORIES
from seal.results.records import describe_failures, load_records, scored
from seal.results.tau2_tasks import TAU2_CATEGORIES

#: Every evaluate-only category: bfcl V4's memory and web search, tau2-bench's domains.
EVAL_OOD_CATEGORIES: tuple[str, ...] = OOD_CATEGORIES + TAU2_CATEGORIES
#: Below this many passes (or failures) a cell shows its Wilson interval instead of ± se.
SMALL_COUNT = 5
#: Two-sided 95 % normal quantile.
Z95 = 1.959964

#: Column titles of the paper's Table 1, in its order.
TABLE_COLUMNS = {
    "average": "Average",
    "base": "Base",
    "miss_func": "Miss Func",
    "miss_param": "Miss Param",
    "long_context": "Long Context",
}


@dataclass
class Cell:
    """Accuracy (0..1) with its binomial standard error; ``n`` episodes, ``passed`` of them valid."""

    accuracy: float
    stderr: float
    n: int
    passed: int | None = None


def wilson_interval(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``passed`` / ``n`` (0..1): honest at 0/n and n/n, unlike p ± z·se."""
    if n <= 0:
        return float("nan"), float("nan")
    p = passed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def is_small(cell: Cell) -> bool:
    """Too few passes or failures for the normal approximation (``± se``) to mean anything."""
    return cell.passed is not None and min(cell.passed, cell.n - cell.passed) < SMALL_COUNT


def honest_stderr(cell: Cell) -> float:
    """The cell's SE for combining it (averages, differences): on a small sample, where sqrt(p(1-p)/n) can be 0
    (0/2), the Wilson interval's half-width / z instead."""
    if not is_small(cell):
        return cell.stderr
    low, high = wilson_interval(cell.passed, cell.n)
    return (high - low) / (2 * Z95)


def binomial_cell(passed: int, n: int) -> Cell:
    p = passed / n if n else float("nan")
    return Cell(p, math.sqrt(p * (1 - p) / n) if n else float("nan"), n, passed)


def pooled_cell(accuracy: float, stderr: float, n: int, passed: int) -> Cell:
    """A cell combining categories: ``accuracy`` a (weighted) mean of theirs, ``passed`` of ``n`` their pooled
    count. Where the mean is not the pooled share (categories of unequal size), a Wilson interval of the pooled count
    would not be centred on the accuracy printed: the cell drops its count and shows ``± stderr`` (the categories'
    honest SEs combined) instead."""
    pooled = passed / n if n else float("nan")
    return Cell(accuracy, stderr, n, passed if math.isclose(accuracy, pooled, abs_tol=1e-12) else None)


def average_cell(cells: list[Cell]) -> Cell:
    """The mean of category accuracies and its standard error (independent categories; a small category's Wilson
    half-width / z in place of its SE)."""
    cells = [c for c in cells if c.n]
    if not cells:
        return Cell(float("nan"), float("nan"), 0, 0)
    k = len(cells)
    return pooled_cell(
        sum(c.accuracy for c in cells) / k,
        math.sqrt(sum(honest_stderr(c) ** 2 for c in cells)) / k,
        sum(c.n for c in cells),
        sum(c.passed or 0 for c in cells),
    )


def category_cells(records: list[dict], categories) -> dict[str, Cell]:
    """{category: Cell} over the scored episodes, for those of ``categories`` present, in their order."""
    kept = scored(records)
    table = {}
    for category in categories:
        rows = [r for r in kept if r["category"] == category]
        if rows:
            table[category] = binomial_cell(sum(bool(r["valid"]) for r in rows), len(rows))
    return table


def accuracy_table(records: list[dict]) -> dict[str, Cell]:
    """{category: Cell} for the categories present, plus ``average``."""
    table = category_cells(records, CATEGORIES)
    table["average"] = average_cell(list(table.values()))
    return table


def ood_table(records: list[dict]) -> dict[str, Cell]:
    """{category: Cell} for the out-of-distribution categories present (never part of the Average)."""
    return category_cells(records, EVAL_OOD_CATEGORIES)


def ood_markdown(table: dict[str, Cell]) -> str:
    if not table:
        return ""
    lines = ["", "Out-of-distribution (evaluate-only; not in the Average):", "", "| category | accuracy | n |"]
    lines.append("| --- | ---: | ---: |")
    lines += [f"| {c} | {pct(cell)} | {cell.n} |" for c, cell in table.items()]
    return "\n".join(lines) + "\n"


def failure_profile(records: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """{"tags"|"labels": {category|"all": {name: share of that category's turns}}} over scored episodes."""
    kept = scored(records)
    profile: dict[str, dict[str, dict[str, float]]] = {}
    for field in ("tags", "labels"):
        per: dict[str, dict[str, float]] = {}
        groups = {c: [r for r in kept if r["category"] == c] for c in CATEGORIES}
        groups["all"] = kept
        for name, rows in groups.items():
            counts = Counter(item for r in rows for item in r.get(field, []))
            total = sum(counts.values())
            if total:
                per[name] = {k: v / total for k, v in sorted(counts.items())}
        profile[field] = per
    return profile


def pct(cell: Cell | None, stderr: bool = True) -> str:
    """``acc ± se`` in percent; ``acc [low, high]`` (95 % Wilson) on a small sample; ``acc`` with ``stderr=False``."""
    if cell is None or cell.n == 0 or math.isnan(cell.accuracy):
        return ""
    if not stderr:
        return f"{100 * cell.accuracy:.2f}"
    if is_small(cell):
        low, high = wilson_interval(cell.passed, cell.n)
        return f"{100 * cell.accuracy:.2f} [{100 * low:.2f}, {100 * high:.2f}]"
    return f"{100 * cell.accuracy:.2f} ± {100 * cell.stderr:.2f}"


def partial_note(cells: dict[str, Cell], parts) -> str:
    """`` (k of N categories)`` when only k of an Average's N categories are in ``cells``, else ''."""
    present = sum(1 for c in parts if c in cells and cells[c].n)
    return "" if present == len(parts) else f" ({present} of {len(parts)} categories)"


def markdown_table(rows: dict[str, dict[str, Cell]]) -> str:
    """One row per model/run: ``rows[name][column]`` (percent ± standard error)."""
    lines = ["| model | " + " | ".join(TABLE_COLUMNS.values()) + " |", "| --- |" + " ---: |" * len(TABLE_COLUMNS)]
    for name, cells in rows.items():
        average = (
            pct(cells.get("average")) + partial_note(cells, CATEGORIES) if cells.get("average", Cell(0, 0, 0)).n else ""
        )
        lines.append(f"| {name} | {average} | " + " | ".join(pct(cells.get(c)) for c in CATEGORIES) + " |")
    return "\n".join(lines) + "\n"


def csv_table(rows: dict[str, dict[str, Cell]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["model", *(f"{t} {k}" for t in TABLE_COLUMNS.values() for k in ("accuracy", "stderr", "n"))])
    for name, cells in rows.items():
        row = [name]
        for column in TABLE_COLUMNS:
            cell = cells.get(column)
            if cell and cell.n:
                row += [f"{100 * cell.accuracy:.4f}", f"{100 * cell.stderr:.4f}", cell.n]
            else:
                row += ["", "", 0]
        writer.writerow(row)
    return out.getvalue()


def profile_markdown(profile: dict) -> str:
    lines = []
    for field, per in profile.items():
        names = sorted({n for shares in per.values() for n in shares})
        if not names:
            continue
        groups = list(per)
        lines += [
            f"**{field}** (share of turns)",
            "",
            f"| {field[:-1]} | " + " | ".join(groups) + " |",
            "| --- |" + " ---: |" * len(groups),
        ]
        for n in names:
            lines.append(f"| {n} | " + " | ".join(f"{100 * per[g].get(n, 0.0):.1f}" for g in groups) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(results_path: str, out_dir: str, name: str) -> dict:
    """Write ``table.{md,csv,json}`` and ``failure_profile.{md,json}`` next to the results; return the JSON."""
    records = load_records(results_path)
    table = accuracy_table(records)
    ood = ood_table(records)
    profile = failure_profile(records)
    failed = [r["task_id"] for r in records if r.get("failed")]
    os.makedirs(out_dir, exist_ok=True)
    summary = {
        "model": name,
        "results": os.path.abspath(results_path),
        "episodes": len(records),
        "env_failures": failed,
        "table": {k: asdict(v) for k, v in table.items()},
        "ood_table": {k: asdict(v) for k, v in ood.items()},
        "failure_profile": profile,
    }
    note = f"\n{describe_failures(records)}\n" if failed else ""
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        paper_table = markdown_table({name: table}) if table["average"].n else ""  # an evaluate-only run: no row
        f.write(paper_table + ood_markdown(ood) + note)
    with open(os.path.join(out_dir, "table.csv"), "w") as f:
        f.write(csv_table({name: table}))
    with open(os.path.join(out_dir, "table.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out_dir, "failure_profile.md"), "w") as f:
        f.write(profile_markdown(profile))
    with open(os.path.join(out_dir, "failure_profile.json"), "w") as f:
        json.dump(profile, f, indent=1)
    return summary
