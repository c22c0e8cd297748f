"""scripts/make_tables.py on a folder of runs: training runs (metrics + validation dumps) and eval results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.stats import binomtest

from seal import paper_numbers
from seal.results.records import append_record, make_record
from tests.support.processes import repo_script

REPO = Path(__file__).resolve().parents[2]
VAL_FILE = REPO / "data" / "bfcl_heldout.parquet"


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
                        "episode_failed": 0.0,
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
    script = repo_script("scripts/make_tables.py")
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
    for column in paper_numbers.COLUMNS:  # every per-category cell of the paper's ablation beside ours
        assert f" / {paper_numbers.ABLATION['wo_reweighting'][column]:.2f} / " in row
    summary = json.loads((tmp_path / "tables.json").read_text())
    assert summary["runs"]["qwen2.5-7b__seal"]["step"] == 10
    assert (tmp_path / "accuracy_over_steps.png").stat().st_size > 10_000


def test_mcnemar_between_runs_on_the_same_tasks(runs, tmp_path):
    script = repo_script("scripts/make_tables.py")
    loaded, _ = script.discover(str(runs), [], "last", str(VAL_FILE))
    assert loaded["qwen2.5-7b__seal"].verdicts is not None  # the validation dump lines up with the val file
    result = script.mcnemar(loaded["qwen2.5-7b__seal"].verdicts, loaded["qwen2.5-7b__base"].verdicts)
    assert (result["tasks"], result["only_a"], result["only_b"]) == (400, 104, 0)
    other = script.mcnemar(loaded["qwen2.5-7b__seal"].verdicts, loaded["wo_reweighting"].verdicts)
    n = other["only_a"] + other["only_b"]
    assert other["p_value"] == pytest.approx(binomtest(other["only_a"], n, 0.5).pvalue)
    script.make_tables(loaded, str(tmp_path))
    assert "| qwen2.5-7b__base vs qwen2.5-7b__seal | 400 | 0 | 104 |" in (tmp_path / "mcnemar.md").read_text()


def test_a_dump_that_does_not_line_up_is_not_used(runs, tmp_path):
    script = repo_script("scripts/make_tables.py")
    other_val = tmp_path / "other.parquet"
    table = pq.read_table(VAL_FILE)
    pq.write_table(table.slice(1), other_val)  # a different val file: rows shifted
    loaded, _ = script.discover(str(runs), [], "last", str(other_val))
    assert loaded["qwen2.5-7b__seal"].verdicts is None


def eval_records(folder: Path, verdicts: dict[str, bool], category: str | None = None) -> None:
    """An evaluation folder's results file: one record per task (``category`` for evaluate-only tasks)."""
    for task_id, valid in verdicts.items():
        evaluation = {"valid": valid, "tags": [], "labels": [], **({"category": category} if category else {})}
        record = make_record(task_id, evaluation, [], model_calls=1, termination="completed", tokens={}, source={})
        append_record(str(folder / "results.jsonl"), record)


def row_of(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {label} |"))


def test_every_paper_cell_of_table1_ablation_and_ood_is_printed(runs, tmp_path):
    script = repo_script("scripts/make_tables.py")
    script.main([str(runs), "--out", str(tmp_path), "--val-file", str(VAL_FILE)])
    table1, ood = (tmp_path / "table1.md").read_text(), (tmp_path / "ood.md").read_text()
    for (backbone, training), numbers in paper_numbers.TABLE1.items():
        label = f"{backbone} {paper_numbers.TRAINING_NAMES[training]}" + (
            "" if training == "base" else " (best checkpoint)"
        )
        cells = row_of(table1, label).split(" | ")[1:]
        assert [c.split(" / ")[1] for c in cells] == [f"{numbers[c]:.2f}" for c in paper_numbers.COLUMNS]
    for (backbone, training), numbers in paper_numbers.OOD.items():
        cells = row_of(ood, f"{backbone} {paper_numbers.TRAINING_NAMES[training]}").split(" | ")[1:]
        assert [c.split(" / ")[1] for c in cells] == [f"{numbers[c]:.2f}" for c in paper_numbers.OOD_COLUMNS]
    for model, average in paper_numbers.REFERENCE_MODELS.items():
        assert row_of(table1, f"{model} (paper's reference)").split(" | ")[1] == f"– / {average:.2f} / –"


def test_the_papers_numbers_are_consistent_with_their_task_counts():
    """Entry check of paper_numbers.py: a tau2 cell is k / tasks (as printed: rounded or cut to 2 decimals); an
    average is the mean of its columns. The two exceptions are the paper's own (noted in paper_numbers.py)."""
    sizes = {"tau2_retail": 114, "tau2_airline": 50, "tau2_telecom": 114}
    off_grid = []
    for row, numbers in paper_numbers.OOD.items():
        for column, n in sizes.items():
            if not any(abs(numbers[column] - 100 * k / n) < 0.011 for k in range(n + 1)):
                off_grid.append((row, column))
        assert numbers["tau2_average"] == pytest.approx(sum(numbers[c] for c in sizes) / 3, abs=0.006)
        if row != ("Qwen2.5-3B-Instruct", "vanilla_rl"):
            assert numbers["v4_average"] == pytest.approx((numbers["web_search"] + numbers["memory"]) / 2, abs=0.006)
    assert off_grid == [(("Qwen2.5-7B-Instruct", "base"), "tau2_telecom")]
    for numbers in list(paper_numbers.TABLE1.values()) + list(paper_numbers.ABLATION.values()):
        assert numbers["average"] == pytest.approx(sum(numbers[c] for c in paper_numbers.COLUMNS[1:]) / 4, abs=0.006)


def test_ood_table_beside_the_papers_with_partial_averages_and_small_samples(tmp_path):
    runs = tmp_path / "runs"
    folder = runs / "qwen2.5-7b__seal__ood"
    folder.mkdir(parents=True)
    eval_records(folder, {f"memory_kv_{i}-customer-{i}": i < 31 for i in range(155)}, "memory_kv")
    eval_records(folder, {f"memory_rec_sum_{i}-customer-{i}": i < 10 for i in range(155)}, "memory_rec_sum")
    eval_records(folder, {f"tau2_retail_{i}": i < 30 for i in range(114)}, "tau2_retail")
    eval_records(folder, {f"tau2_airline_{i}": False for i in range(2)}, "tau2_airline")
    eval_records(folder, {f"tau2_telecom_{i}": i < 16 for i in range(114)}, "tau2_telecom")
    script = repo_script("scripts/make_tables.py")
    assert script.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    row = row_of((tmp_path / "out" / "ood.md").read_text(), "Qwen2.5-7B-Instruct + SEAL").split(" | ")[1:]
    cells = dict(zip(paper_numbers.OOD_COLUMNS, row))
    # memory without its vector backend: shown as partial, never compared with the paper's Memory or V4 Avg.
    assert (
        cells["memory"]
        == f"{100 * (31 + 10) / 310:.2f} ± {100 * math.sqrt(0.2 * 0.8 / 155 + 10 / 155 * 145 / 155 / 155) / 2:.2f} (partial: 2 of 3) / 15.92 / –"
    )
    assert cells["v4_average"].endswith("(partial: 2 of 5) / 12.71 / –")
    assert cells["web_search"] == "– / 9.50 / –"
    # 0 of 2 airline tasks: the Wilson interval (upper bound by hand, z = 1.96: 2·0.9604/2.9207), not "± 0.00";
    # in the difference (and the average) its half-width / z stands in for the zero binomial SE
    airline_se = 0.6576 / 2 / 1.96
    paper_airline_se = math.sqrt(0.22 * 0.78 / 50)
    assert (
        cells["tau2_airline"]
        == f"0.00 [0.00, 65.76] / 22.00 / -22.00 ± {100 * math.hypot(airline_se, paper_airline_se):.2f}"
    )
    retail_se = math.sqrt(30 / 114 * 84 / 114 / 114)
    assert cells["tau2_retail"].startswith(f"26.32 ± {100 * retail_se:.2f} / 26.32 / -0.00 ± ")  # 30/114 = 26.316
    tau2 = (30 / 114 + 0 + 16 / 114) / 3
    tau2_se = math.sqrt(retail_se**2 + airline_se**2 + 16 / 114 * 98 / 114 / 114) / 3
    assert cells["tau2_average"].startswith(f"{100 * tau2:.2f} ± {100 * tau2_se:.2f} / 20.79 / ")  # compared
    assert cells["tau2_average"].split(" / ")[2].startswith(f"{100 * (tau2 - 0.2079):+.2f} ± ")


def write_factorial_run(folder: Path, passing: int, tasks: int = 100) -> None:
    """Per category of the held-out set, its first ``tasks`` evaluated: the first ``passing`` of them pass."""
    ids = [t for t, _ in heldout_rows()]
    verdicts = {}
    for c in paper_numbers.COLUMNS[1:]:
        in_category = [t for t in ids if f"multi_turn_{c}_" in t][:tasks]
        verdicts.update({t: i < passing for i, t in enumerate(in_category)})
    eval_records(folder, verdicts)


def test_factorial_interaction_paired_beside_the_papers_stated_and_implied(tmp_path):
    runs = tmp_path / "runs"
    # per category: full passes tasks 0-44, env only 0-29, reweighting only 0-34, neither 0-24
    write_factorial_run(runs / "SEAL", 45)
    write_factorial_run(runs / "wo_reweighting", 30)
    write_factorial_run(runs / "wo_env_adaptation", 35)
    write_factorial_run(runs / "qwen2.5-7b__vanilla_rl", 25)  # the ablation's Vanilla RL falls back to Table 1's
    script = repo_script("scripts/make_tables.py")
    assert script.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "interaction.md").read_text()
    # by hand, per task: 25-29 give 1-1-1+0 = -1, 35-44 give +1, the rest 0 -> mean 5/100 = +0.05; the sample
    # variance (n - 1), as numpy computes it -> SE sqrt(variance/100) per category, /2 for the mean of four
    variance = float(np.var([-1] * 5 + [1] * 10 + [0] * 85, ddof=1))
    ours = row_of(text, "ours (paired on 400 shared tasks)").split(" | ")[1:]
    per_category = f"+5.00 ± {100 * math.sqrt(variance / 100):.2f}"
    assert ours == [f"+5.00 ± {100 * math.sqrt(variance / 100) / 2:.2f}"] + [per_category] * 3 + [per_category + " |"]
    assert row_of(text, "paper, as its revised abstract states").split(" | ")[1] == "+5.00"
    implied = row_of(text, "paper, as its own ablation cells imply (± SE of independent binomial cells)")
    # 40.25 − 32.75 − 35.75 + 30.75; Base 58 − 48 − 52 + 46; Miss Func 36 − 27 − 31 + 27; ...
    assert [c.split(" ± ")[0] for c in implied.split(" | ")[1:]] == ["+2.50", "+4.00", "+5.00", "-2.00", "+3.00"]
    summary = json.loads((tmp_path / "out" / "tables.json").read_text())["interaction"]
    assert summary["stated_by_paper"] == 5.0 and summary["implied_by_paper_table"]["average"] == pytest.approx(2.5)
    assert summary["ours"]["average"]["paired"] and summary["ours"]["average"]["tasks"] == 400


def test_factorial_interaction_unpaired_when_the_runs_scored_different_tasks(tmp_path):
    runs = tmp_path / "runs"
    write_factorial_run(runs / "SEAL", 45)
    write_factorial_run(runs / "wo_reweighting", 30)
    write_factorial_run(runs / "wo_env_adaptation", 35)
    write_factorial_run(runs / "vanilla_rl", 25, tasks=50)  # half the tasks: no per-task pairing
    script = repo_script("scripts/make_tables.py")
    assert script.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    # by hand: 0.45 − 0.30 − 0.35 + 0.50 per category, SE from four independent binomial cells
    se = math.sqrt(0.45 * 0.55 / 100 + 0.30 * 0.70 / 100 + 0.35 * 0.65 / 100 + 0.5 * 0.5 / 50)
    ours = row_of((tmp_path / "out" / "interaction.md").read_text(), "ours (unpaired)").split(" | ")[1:]
    assert ours[0] == f"+30.00 ± {100 * se / 2:.2f}" and ours[1] == f"+30.00 ± {100 * se:.2f}"


def test_partial_average_is_not_compared_and_unreadable_runs_are_named(runs, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    (root / "qwen2.5-7b__seal").symlink_to(runs / "qwen2.5-7b__seal")
    base_only = {t: True for t, _ in heldout_rows()[:10] if "_base_" in t}
    eval_records(root / "qwen2.5-3b__seal", base_only)
    (root / "qwen2.5-7b__vanilla_rl").mkdir()  # neither results nor metrics
    script = repo_script("scripts/make_tables.py")
    assert (
        script.main([str(root), "--out", str(tmp_path / "out"), "--val-file", str(tmp_path / "nowhere.parquet")]) == 0
    )
    table1 = (tmp_path / "out" / "table1.md").read_text()
    average = row_of(table1, "Qwen2.5-3B-Instruct + SEAL (best checkpoint)").split(" | ")[1]
    assert average == "100.00 [72.25, 100.00] (partial: 1 of 4) / 14.00 / –"
    vanilla = next(line for line in table1.splitlines() if line.startswith("| Qwen2.5-7B-Instruct + Vanilla RL"))
    assert "(run unreadable: " in vanilla and "qwen2.5-7b__vanilla_rl" in vanilla and "metrics" in vanilla
    runs_md = (tmp_path / "out" / "runs.md").read_text()
    assert "- qwen2.5-7b__vanilla_rl: unreadable (" in runs_md
    assert (
        f"- qwen2.5-7b__seal: per-task verdicts unavailable (validation file {tmp_path / 'nowhere.parquet'}" in runs_md
    )


def test_relative_paths_are_the_working_directorys_and_the_default_val_file_the_repositorys(
    runs, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here").symlink_to(runs)
    script = repo_script("scripts/make_tables.py")
    assert script.main(["here", "--out", "tables_out"]) == 0  # no --val-file: the repository's held-out parquet
    summary = json.loads((tmp_path / "tables_out" / "tables.json").read_text())
    assert summary["runs"]["qwen2.5-7b__seal"]["note"] == ""  # its validation dump was read against the val file
    assert summary["runs"]["qwen2.5-7b__seal"]["path"] == str(tmp_path / "here" / "qwen2.5-7b__seal")
    assert "| qwen2.5-7b__base vs qwen2.5-7b__seal | 400 |" in (tmp_path / "tables_out" / "mcnemar.md").read_text()


# ---- best and last checkpoints, the paper-method row, the statistics ---------------------------------------------


def test_best_and_last_checkpoint_side_by_side_for_every_trained_row(tmp_path):
    """Every trained row of Table 1 and the ablation (and the paper-method row) shows its best checkpoint, compared
    with the paper, and its last, beside it and compared with nothing; the paper-method row has no paper cell."""
    from seal.report import reproduction

    runs = tmp_path / "runs"
    trained = [t.row for t in reproduction.trainings()]
    for i, row in enumerate(trained):
        write_factorial_run(runs / row, 40 + i)  # best: 40 + i of 100 per category
        write_factorial_run(runs / f"{row}{reproduction.LAST_SUFFIX}", 20 + i)  # last: 20 + i
    script = repo_script("scripts/make_tables.py")
    assert script.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    table1, ablation = (tmp_path / "out" / "table1.md").read_text(), (tmp_path / "out" / "ablation.md").read_text()
    labels = {(b, t): f"{b} {paper_numbers.TRAINING_NAMES[t]}" for b, t in paper_numbers.TABLE1 if t != "base"}
    labels.update({name: paper_numbers.ABLATION_NAMES[name] for name in reproduction.ABLATIONS})
    for i, row in enumerate(trained):
        if row == reproduction.PAPER_METHOD:
            table, label, paper = table1, "Qwen2.5-7B-Instruct + SEAL, as the paper describes it (no paper cell)", None
        elif row in reproduction.ABLATIONS:
            table, label, paper = ablation, labels[row], paper_numbers.ABLATION[row]["average"]
        else:
            backbone, _, training = row.partition("__")
            key = (script.BACKBONE_KEYS[backbone], training)
            table, label, paper = table1, labels[key], paper_numbers.TABLE1[key]["average"]
        best = row_of(table, f"{label} (best checkpoint)").split(" | ")[1]
        last = row_of(table, f"{label} (last checkpoint, unbiased)").split(" | ")[1]
        assert best.startswith(f"{40 + i:.2f} ± ") and last.startswith(f"{20 + i:.2f} ± "), row
        assert last.endswith(" / – / –"), row  # the unbiased score is not compared with a best-selected number
        if paper is None:
            assert best.endswith(" / – / –")
        else:
            assert f" / {paper:.2f} / {40 + i - paper:+.2f} ± " in best, row


def test_mcnemar_tests_the_unbiased_runs_and_adjusts_by_holm(tmp_path):
    runs = tmp_path / "runs"
    write_factorial_run(runs / "qwen2.5-7b__base", 14)
    write_factorial_run(runs / "qwen2.5-7b__seal", 45)  # best: left out, its row has a last checkpoint
    write_factorial_run(runs / "qwen2.5-7b__seal__last", 30)
    write_factorial_run(runs / "qwen2.5-7b__vanilla_rl", 25)  # no last: the only evaluation of its row
    write_factorial_run(runs / "qwen2.5-7b__seal__training", 44)  # an evaluation folder named as a training run
    script = repo_script("scripts/make_tables.py")
    assert script.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    tests = json.loads((tmp_path / "out" / "tables.json").read_text())["mcnemar"]
    assert sorted(tests) == [
        "qwen2.5-7b__base vs qwen2.5-7b__seal__last",
        "qwen2.5-7b__base vs qwen2.5-7b__vanilla_rl",
        "qwen2.5-7b__seal__last vs qwen2.5-7b__vanilla_rl",
    ]
    # by hand: per category the first k tasks pass, so A passes where B fails only when A's k is larger
    only = {"qwen2.5-7b__base": 14, "qwen2.5-7b__seal__last": 30, "qwen2.5-7b__vanilla_rl": 25}
    raw = {}
    for name, test in tests.items():
        a, b = name.split(" vs ")
        only_a, only_b = 4 * max(only[a] - only[b], 0), 4 * max(only[b] - only[a], 0)
        assert (test["only_a"], test["only_b"]) == (only_a, only_b)
        raw[name] = binomtest(only_a, only_a + only_b, 0.5).pvalue  # exact McNemar = binomial test on discordant
        assert test["p_value"] == pytest.approx(raw[name])
    # Holm from first principles: the i-th smallest of m times (m - i + 1), running maximum, capped at 1
    ordered = sorted(raw, key=raw.get)
    expected, running = {}, 0.0
    for i, name in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - i) * raw[name]))
        expected[name] = running
    assert {n: t["p_holm"] for n, t in tests.items()} == pytest.approx(expected)
    assert "(Holm)" in (tmp_path / "out" / "mcnemar.md").read_text()


def test_the_papers_small_cells_get_the_wilson_treatment_ours_get():
    """Qwen2.5-3B base's Miss Param (3.00 = 3/100): in a difference, its Wilson half-width / z is its SE, as scipy's
    Wilson interval gives it; a large cell keeps its binomial SE."""
    script = repo_script("scripts/make_tables.py")
    ours = script.Cell(0.10, math.sqrt(0.1 * 0.9 / 100), 100, 10)
    small = script.paper_cell(3.00, {"miss_param": 1.0}, script.TABLE1_SIZES)
    wilson = binomtest(3, 100).proportion_ci(confidence_level=0.95, method="wilson")
    paper_se = (wilson.high - wilson.low) / 2 / 1.959964
    assert script.difference(ours, small) == f"+7.00 ± {100 * math.hypot(ours.stderr, paper_se):.2f}"
    large = script.paper_cell(40.00, {"base": 1.0}, script.TABLE1_SIZES)
    assert script.difference(ours, large) == f"-30.00 ± {100 * math.hypot(ours.stderr, math.sqrt(0.24 / 100)):.2f}"


def test_an_average_of_unequal_categories_is_shown_around_the_mean_it_prints():
    """0/2 and 1/10: the mean of the two accuracies is 5 %, the pooled count 1/12; the cell prints 5.00 with the
    categories' SEs (Wilson half-width / z for small ones, from scipy) combined, not the Wilson interval of 1/12."""
    from seal.results import tables

    average = tables.average_cell([tables.binomial_cell(0, 2), tables.binomial_cell(1, 10)])
    ses = []
    for passed, n in ((0, 2), (1, 10)):
        ci = binomtest(passed, n).proportion_ci(confidence_level=0.95, method="wilson")
        ses.append((ci.high - ci.low) / 2 / 1.959964)
    assert tables.pct(average) == f"5.00 ± {100 * math.hypot(*ses) / 2:.2f}"
    equal = tables.average_cell([tables.binomial_cell(0, 10), tables.binomial_cell(1, 10)])  # mean = pooled 1/20
    ci = binomtest(1, 20).proportion_ci(confidence_level=0.95, method="wilson")
    assert tables.pct(equal) == f"5.00 [{100 * ci.low:.2f}, {100 * ci.high:.2f}]"


def test_the_interaction_note_says_where_the_papers_two_figures_come_from(tmp_path):
    script = repo_script("scripts/make_tables.py")
    text = script.interaction_table({}, {})
    # by hand: the four ablation cells' binomial SEs on 400 tasks, independent
    cells = (40.25, 32.75, 35.75, 30.75)
    se = 100 * math.sqrt(sum(p / 100 * (1 - p / 100) / 400 for p in cells))
    assert "come from different versions of the paper" in text and f"(± {se:.2f})" in text
    assert f"+5.00 lies {5.00 / se:.2f} SE from 0 and +2.50 {2.50 / se:.2f} SE" in text
    assert "neither is distinguishable from no interaction" in text
