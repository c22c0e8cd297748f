"""scripts/make_tables.py on a folder of runs: training runs (metrics + validation dumps) and eval results."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from scipy.stats import binomtest

from seal import paper_numbers
from seal.eval.records import append_record, make_record

REPO = Path(__file__).resolve().parents[1]
VAL_FILE = REPO / "data" / "bfcl_heldout.parquet"


def load_script():
    spec = importlib.util.spec_from_file_location("make_tables", REPO / "scripts" / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def heldout_rows():
    table = pq.read_table(VAL_FILE, columns=["extra_info", "reward_model"])
    return [
        (e["task_id"], r["ground_truth"])
        for e, r in zip(table.column("extra_info").to_pylist(), table.column("reward_model").to_pylist())
    ]


def write_training_run(run: Path, passes: dict[int, set[str]]) -> None:
    """A run dir as the trainer leaves it: metrics_*.jsonl with val-core metrics, validation_log/<step>.jsonl."""
    rows = heldout_rows()
    run.mkdir(parents=True)
    with open(run / "metrics_1.jsonl", "w") as f:
        for step, passed in passes.items():
            data = {"training/global_step": step}
            for c in paper_numbers.COLUMNS[1:]:
                ids = [t for t, _ in rows if f"multi_turn_{c}_" in t]
                data[f"val-core/multi_turn_{c}/reward/mean@1"] = sum(t in passed for t in ids) / len(ids)
            f.write(json.dumps({"step": step, "data": data}) + "\n")
            f.write(json.dumps({"step": step, "data": {"seal/apatch/mean_scale": 1.1}}) + "\n")
    (run / "validation_log").mkdir()
    step = max(passes)
    with open(run / "validation_log" / f"{step}.jsonl", "w") as f:
        for task_id, gt in rows:
            f.write(
                json.dumps(
                    {
                        "input": "",
                        "output": "",
                        "gts": gt,
                        "score": float(task_id in passes[step]),
                        "step": step,
                        "env_failed": 0.0,
                    }
                )
                + "\n"
            )


def write_eval_run(folder: Path, passed: set[str]) -> None:
    for task_id, _ in heldout_rows():
        append_record(
            str(folder / "results.jsonl"),
            make_record(
                task_id,
                {"valid": task_id in passed, "tags": [], "labels": []},
                [],
                model_calls=1,
                termination="completed",
                tokens={},
                source={},
            ),
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    ids = [t for t, _ in heldout_rows()]
    per_cat = {c: [t for t in ids if f"multi_turn_{c}_" in t] for c in paper_numbers.COLUMNS[1:]}
    seal_last = {t for c, ts in per_cat.items() for t in ts[:40]}  # 40 % everywhere
    write_training_run(root / "qwen2.5-7b__seal", {0: set(per_cat["base"][:10]), 10: seal_last})
    base = {t for ts in per_cat.values() for t in ts[:14]}  # 14 %
    write_eval_run(root / "qwen2.5-7b__base", base)
    write_training_run(root / "wo_reweighting", {10: {t for ts in per_cat.values() for t in ts[5:38]}})
    return root


def test_tables_put_the_papers_numbers_beside_ours(runs, tmp_path):
    script = load_script()
    assert script.main([str(runs), "--out", str(tmp_path), "--val-file", str(VAL_FILE)]) == 0
    table1 = (tmp_path / "table1.md").read_text()
    seal_row = next(line for line in table1.splitlines() if line.startswith("| Qwen2.5-7B-Instruct + SEAL"))
    se = 100 * math.sqrt(0.4 * 0.6 / 100) / 2  # our average's standard error (four categories of 100)
    paper_se = 100 * math.sqrt(0.4025 * 0.5975 / 400)
    assert f"40.00 ± {se:.2f} / 40.25 / -0.25 ± {math.hypot(se, paper_se):.2f}" in seal_row
    base_row = next(line for line in table1.splitlines() if line.startswith("| Qwen2.5-7B-Instruct base model"))
    assert "14.00 ± " in base_row and "/ 22.00 /" in base_row  # paper's Base column beside ours
    missing = next(line for line in table1.splitlines() if line.startswith("| Qwen2.5-3B-Instruct + SEAL"))
    assert "– / 14.00 / –" in missing  # no run: our cell and the difference stay empty
    ablation = (tmp_path / "ablation.md").read_text()
    row = next(line for line in ablation.splitlines() if line.startswith("| w/o reweighting"))
    assert "33.00 ± 2.35 / 32.75 / +0.25 ± " in row
    assert row.count(" / – / –") == 4  # the paper reports no per-category ablation numbers: left empty
    summary = json.loads((tmp_path / "tables.json").read_text())
    assert summary["runs"]["qwen2.5-7b__seal"]["step"] == 10
    assert (tmp_path / "accuracy_over_steps.png").stat().st_size > 10_000


def test_mcnemar_between_runs_on_the_same_tasks(runs, tmp_path):
    script = load_script()
    loaded = script.discover(str(runs), [], "last", str(VAL_FILE))
    assert loaded["qwen2.5-7b__seal"].verdicts is not None  # the validation dump lines up with the val file
    result = script.mcnemar(loaded["qwen2.5-7b__seal"].verdicts, loaded["qwen2.5-7b__base"].verdicts)
    assert (result["tasks"], result["only_a"], result["only_b"]) == (400, 104, 0)
    other = script.mcnemar(loaded["qwen2.5-7b__seal"].verdicts, loaded["wo_reweighting"].verdicts)
    n = other["only_a"] + other["only_b"]
    assert other["p_value"] == pytest.approx(binomtest(other["only_a"], n, 0.5).pvalue)
    script.make_tables(loaded, str(tmp_path))
    assert "| qwen2.5-7b__base vs qwen2.5-7b__seal | 400 | 0 | 104 |" in (tmp_path / "mcnemar.md").read_text()


def test_a_dump_that_does_not_line_up_is_not_used(runs, tmp_path):
    script = load_script()
    other_val = tmp_path / "other.parquet"
    table = pq.read_table(VAL_FILE)
    pq.write_table(table.slice(1), other_val)  # a different val file: rows shifted
    loaded = script.discover(str(runs), [], "last", str(other_val))
    assert loaded["qwen2.5-7b__seal"].verdicts is None
