"""The paper's reproduction plan and its CPU rehearsal (``scripts/reproduce.py``, ``seal/report/reproduction.py``).

The plan names a command for every cell of Table 1, the ablation and the OOD table; a rehearsal command differs
from its plan command only by the swap (``seal/config/swap/cpu.yaml``) and the documented command-line swaps; the
rehearsal itself (slow) runs the chain on CPU and ends in the tables and figures, built from every run it made.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seal import paper_numbers as paper
from seal.eval.tau2 import tau2_python
from seal.launch.recipe import compose_recipe
from seal.report import reproduction
from seal.report.reproduction import leaves
from seal.results.records import load_records
from seal.results.runs import load_run, read_metrics, validation_steps

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import make_tables  # noqa: E402

STUB = "http://127.0.0.1:1/v1"


@pytest.fixture(scope="module")
def plan():
    return reproduction.plan("OUT")


@pytest.fixture(scope="module")
def rehearsal():
    return reproduction.rehearsal("OUT", STUB)


def rows_of(steps, kind):
    return {s.row for s in steps if s.kind == kind}


def test_the_plan_fills_every_cell_of_the_papers_tables(plan):
    evaluated = rows_of(plan, "eval")
    for backbone, training in paper.TABLE1:
        assert make_tables.row_key(backbone, training) in evaluated
    for name in paper.ABLATION:  # full SEAL and Vanilla RL are Table 1's rows
        assert name in evaluated or make_tables.ABLATION_FALLBACK[name] in evaluated
    # the OOD evaluations are the paper's OOD table's rows: the ToolACE rows fill no cell there and are dropped
    assert rows_of(plan, "ood") == {make_tables.row_key(b, t) for b, t in paper.OOD}
    assert {s.row for s in plan if s.kind == "ood" and "--user-endpoint" in s.argv} == rows_of(plan, "ood")  # tau2
    # each serves its model for its own length (started, watched, stopped by seal.eval): no step left to the user
    assert all("--serve" in s.argv for s in plan if s.kind == "ood") and {s.argv[0] for s in plan} == {"python"}


def test_every_trained_row_evaluates_its_best_and_its_last_checkpoint(plan):
    evals = {s.row: s for s in plan if s.kind == "eval"}
    for row in rows_of(plan, "train"):
        best, last = evals[row], evals[row + reproduction.LAST_SUFFIX]
        model = best.argv[best.argv.index("--model") + 1]
        assert model == f"OUT/checkpoints/{row}/best"
        assert last.argv[last.argv.index("--model") + 1] == f"OUT/checkpoints/{row}"  # its latest: the last step
        assert "best checkpoint" in best.fills and "last checkpoint (unbiased)" in last.fills
    train = next(s for s in plan if s.kind == "train" and s.row == "qwen2.5-7b__seal")
    assert "trainer.save_freq=72" in train.argv  # the last step is saved (6 epochs of 12 batches)


def test_the_paper_method_row_is_an_extra_table1_line_with_no_paper_cell(plan):
    trained = {s.row: s for s in plan if s.kind == "train"}
    step = trained[reproduction.PAPER_METHOD]
    assert step.recipe == "exp/SEAL_interface_evolution.yaml"
    assert "as the paper describes it" in step.fills and "no paper cell" in step.fills
    config = compose_recipe(str(REPO / step.recipe), overrides(step))
    assert config.actor_rollout_ref.model.path == "Qwen/Qwen2.5-7B-Instruct"
    assert config.env_service.bfcl.tool_feedback_evolution.enable and config.env_service.bfcl.capability_cues.enable
    assert make_tables.table1_key(reproduction.PAPER_METHOD) is None  # never read as one of the paper's rows
    assert reproduction.PAPER_METHOD not in rows_of(plan, "ood")


def test_the_plan_trains_before_it_evaluates_and_tabulates_last(plan):
    position = {(s.kind, s.row): i for i, s in enumerate(plan)}
    for row in rows_of(plan, "train"):
        assert position[("train", row)] < position[("eval", row)]
    assert plan[-1].kind == "tables" and [s.kind for s in plan].count("tables") == 1
    trained = rows_of(plan, "train")
    evaluated = {r.removesuffix(reproduction.LAST_SUFFIX) for r in rows_of(plan, "eval")}
    assert trained == {r for r in evaluated if not r.endswith("__base")}


def test_every_paper_recipe_trains_a_row(plan):
    recipes = {s.recipe for s in plan if s.kind == "train"}
    paper_recipes = {
        f"exp/{n}.yaml" for n in ("SEAL", "vanilla_rl", "qwen2.5_3b", "toolace2_8b", *reproduction.ABLATIONS)
    }
    assert paper_recipes <= recipes


def overrides(step) -> list[str]:
    """The Hydra overrides of a launcher or seal.eval command (after --conf RECIPE, or after --)."""
    argv = step.argv
    tail = argv[argv.index("--") + 1 :] if "--" in argv else argv[argv.index(step.recipe) + 1 :]
    return [a for a in tail if "=" in a and not a.startswith("--")]


def test_vanilla_rl_on_another_backbone_is_vanilla_rl_with_that_backbone(plan):
    by_row = {s.row: s for s in plan if s.kind == "train"}
    vanilla = leaves(compose_recipe(str(REPO / "exp/vanilla_rl.yaml")))
    seal_7b = leaves(compose_recipe(str(REPO / "exp/SEAL.yaml")))
    for backbone in ("qwen2.5-3b", "toolace2-8b"):
        step = by_row[f"{backbone}__vanilla_rl"]
        ours = leaves(compose_recipe(str(REPO / step.recipe), overrides(step)))
        seal = leaves(compose_recipe(str(REPO / step.recipe)))
        backbone_keys = {k for k in seal if seal[k] != seal_7b.get(k)}
        assert backbone_keys  # the backbone's own keys (its model, for ToolACE its prompt format)
        differs = {k for k in ours if ours[k] != vanilla.get(k)} - backbone_keys
        assert differs <= {"trainer.experiment_name", "seal.run_dir", "trainer.default_local_dir", "trainer.save_freq"}


def flag_values(argv: list[str]) -> dict[str, str | None]:
    """{--flag: its value (None for a switch)} of a command line, up to a ``--``."""
    argv = argv[: argv.index("--")] if "--" in argv else argv
    return {
        a: (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
        for i, a in enumerate(argv)
        if a.startswith("--")
    }


def test_a_rehearsal_changes_nothing_outside_the_swap(plan, rehearsal):
    """Composed config by composed config: every key a rehearsal command changes is one of the swap's; on the
    command line, only the documented swaps of each kind of command."""
    swap_keys = set(reproduction.swap_values())
    planned = {(s.kind, s.row): s for s in plan}
    checked = 0

    @functools.cache
    def composed(recipe: str, switches: tuple[str, ...]) -> dict:  # a row's best and last evaluations share one
        return leaves(compose_recipe(str(REPO / recipe), list(switches)))

    for step in rehearsal:
        gpu = planned[(step.kind, step.row)]
        ours, theirs = flag_values(step.argv), flag_values(gpu.argv)
        flags = {f for f in ours.keys() | theirs.keys() if ours.get(f) != theirs.get(f)}
        assert flags <= set(reproduction.COMMAND_SWAPS[step.kind]), (step.row, flags)
        if step.kind in ("train", "eval"):
            ours = composed(step.recipe, tuple(overrides(step)))
            theirs = composed(gpu.recipe, tuple(overrides(gpu)))
            changed = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
            assert changed <= swap_keys, (step.row, sorted(changed - swap_keys))
            assert changed, step.row  # the swap took effect
            checked += 1
    assert checked == len(rows_of(plan, "train")) + len(rows_of(plan, "eval"))


def test_the_llama_backbone_is_rehearsed_with_a_llama_tokenizer(rehearsal):
    step = next(s for s in rehearsal if s.kind == "train" and s.row == "toolace2-8b__seal")
    config = compose_recipe(str(REPO / step.recipe), overrides(step))
    assert config.seal.tiny_model.shape == "bfcl_bpe_llama3"
    assert config.actor_rollout_ref.model.path == config.seal.tiny_model.out_dir
    assert config.seal.rollout.end_of_turn_token == "<|eot_id|>"  # the recipe's, kept


def test_gpu_hours_follow_the_recipes_sizes_and_kv_cache_by_hand():
    """exp/SEAL.yaml on 4 H100s at the low end of the range, by hand from the recipe's sizes and Qwen2.5-7B's config
    numbers (the KV capacity is test_memory_estimate's hand computation)."""
    config = compose_recipe(str(REPO / "exp/SEAL.yaml"))
    h100, low = reproduction.GPU_TYPES[0], reproduction.ASSUMPTIONS[0]
    assert (h100.peak_flops, h100.bandwidth, low.mfu, low.bandwidth_share) == (989e12, 3.35e12, 0.4, 0.6)
    found = reproduction.cost(config, "train", h100, low)
    p = 7_615_616_512
    kv_tokens, kv_token_bytes, weights = 296_125, 2 * 28 * 4 * 128 * 2, 2 * p  # per replica (TP 1)
    context, generated = int(0.4 * 16384), int(0.25 * int(0.4 * 16384))  # 6,553 and 1,638
    prefill = context - generated + (6 - 1) * context / 2 * (1 - 0.8)  # 6 calls, 80 % of contexts cached
    flops_rate = 4 * 989e12 * 0.4
    at_once = min(64, 256, kv_tokens // context)  # 256 episodes over 4 replicas; what the cache holds: 45
    rate = at_once * 3.35e12 * 0.6 / (weights + at_once * context * kv_token_bytes)
    step_s = 256 * prefill * 2 * p / flops_rate + 64 * generated / rate  # rollout
    step_s += 256 * context * p * 12 / flops_rate + 20 + 10  # training (12 FLOPs: recomputation), sync, environment
    val_s = 400 * prefill * 2 * p / flops_rate + 100 * generated / rate
    saves_s = (2 * p * (4 + 8) + p * 2) / 2e9  # the last and one best (fp32 weights + Adam), the best's bf16 export
    wall = 600 + 72 * step_s + 9 * val_s + saves_s  # 72 steps, 9 validations (before, at 10..70, after the last)
    assert (found.steps, found.train_episodes, found.val_episodes, found.gpus) == (72, 72 * 256, 9 * 400, 4)
    assert (found.decode.kv_tokens, found.decode.at_once, found.flops_per_parameter) == (kv_tokens, 45, 12)
    assert found.gpu_hours == pytest.approx(wall * 4 / 3600)
    high = reproduction.cost(config, "train", h100, reproduction.ASSUMPTIONS[1])
    a100 = reproduction.cost(config, "train", reproduction.GPU_TYPES[1], low)
    assert found.gpu_hours < high.gpu_hours and found.gpu_hours < a100.gpu_hours
    more_kv = reproduction.cost(
        compose_recipe(str(REPO / "exp/SEAL.yaml"), ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]),
        "train",
        h100,
        low,
    )
    assert more_kv.decode.at_once == 64 and more_kv.gpu_hours < found.gpu_hours  # the KV cache sets the decode rate
    half = reproduction.cost(compose_recipe(str(REPO / "exp/SEAL.yaml"), ["trainer.total_epochs=3"]), "train")
    assert half.steps == 36 and half.gpu_hours < found.gpu_hours


def test_plan_prints_every_command_with_its_cost():
    done = subprocess.run(
        [sys.executable, "scripts/reproduce.py", "--plan", "--out", "X"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for step in reproduction.plan("X"):
        assert step.command() in done.stdout
    costed = [s for s in reproduction.plan("X") if s.kind in ("train", "eval")]
    for gpu in reproduction.GPU_TYPES:  # a range per GPU type for every training and evaluation
        assert done.stdout.count(f"GPU-hours on 4 x {gpu.name} (decode per replica, low: KV cache ") == len(costed)
    for name in vars(reproduction.ASSUMPTIONS[0]):  # the assumptions, printed
        assert f"\n  {name}: " in done.stdout or name == "name"
    assert done.stdout.count("12 training FLOPs per parameter and token") == len(
        rows_of(reproduction.plan("X"), "train")
    )


def test_the_last_checkpoints_evaluation_shares_the_bests_only_when_they_are_one_checkpoint(tmp_path):
    row = "qwen2.5-7b__seal"
    checkpoints = tmp_path / "checkpoints" / row
    for step in (1, 2):  # two exported checkpoints; the best is step 1
        export = checkpoints / f"global_step_{step}" / "huggingface"
        export.mkdir(parents=True)
        (export / "config.json").write_text("{}")
        (export / "model.safetensors").write_text("")
    (checkpoints / "best").symlink_to("global_step_1")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("2")
    best_argv = reproduction.eval_argv(row, "exp/SEAL.yaml", f"{checkpoints}/best", str(tmp_path))
    last_argv = reproduction.eval_argv(f"{row}__last", "exp/SEAL.yaml", str(checkpoints), str(tmp_path))
    last = reproduction.Step("eval", f"{row}{reproduction.LAST_SUFFIX}", last_argv, "", "exp/SEAL.yaml")
    chain = [reproduction.Step("eval", row, best_argv, "", "exp/SEAL.yaml"), last]
    (tmp_path / "runs" / row).mkdir(parents=True)  # the best's evaluation, run before it
    assert not reproduction.share_best_evaluation(last, chain)  # step 2 is not the best: evaluated on its own
    assert not (tmp_path / "runs" / f"{row}__last").exists()
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("1")  # a run whose last step was its best
    assert reproduction.share_best_evaluation(last, chain)
    assert (tmp_path / "runs" / f"{row}__last").resolve() == (tmp_path / "runs" / row).resolve()


def test_an_unknown_row_is_refused_in_one_line():
    done = subprocess.run(
        [sys.executable, "scripts/reproduce.py", "--rehearse", "--rows", "qwen2.5-7b__sael"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "unknown rows" in done.stderr and "Traceback" not in done.stderr


def test_rows_side_by_side_share_the_cores_unless_the_user_set_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert reproduction.job_threads(1) == {}  # one row at a time: every core, as any CPU run
    assert reproduction.job_threads(2) == {"OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert reproduction.job_threads(4 * cores) == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert reproduction.job_threads(2) == {}  # the user's choice stands


# ---- the rehearsal, end to end ---------------------------------------------------------------------

#: The rows CI rehearses: SEAL as the paper describes it and Vanilla RL on Qwen2.5-7B (the trainer with and without
#: diagnosis and A-Patch; the environment with and without its whole interface evolution) and the released SEAL
#: recipe on ToolACE-2-8B (the Llama-3.1 format), each trained, its best and last checkpoints evaluated (one
#: checkpoint after one step: the last shares the best's evaluation), Vanilla RL's out of distribution too, then the
#: tables: every join of the chain. The other rows' commands differ from these in recipe switches only, which the
#: composition tests above check for every row.
CI_ROWS = (reproduction.PAPER_METHOD, "qwen2.5-7b__vanilla_rl", "toolace2-8b__seal")


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    out = tmp_path_factory.mktemp("rehearsal")
    done = subprocess.run(
        [sys.executable, "scripts/reproduce.py", "--rehearse", "--out", str(out), "--rows", ",".join(CI_ROWS)]
        + ["--jobs", "2"],  # two rows side by side, each with its share of the cores: their start-ups overlap
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, json.loads((out / "tables" / "tables.json").read_text())


@pytest.mark.slow
def test_the_rehearsal_ends_in_the_papers_tables_and_figures(rehearsed):
    out, summary = rehearsed
    for name in ("table1.md", "ablation.md", "ood.md", "interaction.md", "accuracy_over_steps.png"):
        assert (out / "tables" / name).stat().st_size > 0, name
    for row in CI_ROWS:
        for evaluation in (row, row + reproduction.LAST_SUFFIX):  # its best and its last checkpoint
            assert summary["runs"][evaluation]["cells"]["average"]["n"] == 4, evaluation  # the swap's 4 tasks
        figures = {p.name for p in (out / "runs" / f"{row}__training").glob("*.png")}
        # Vanilla RL has no diagnosis and no A-Patch: nothing to draw of them
        drawn = {"accuracy_bands.png"} | ({"tag_shares.png", "apatch_weights.png"} if "vanilla" not in row else set())
        assert drawn <= figures, (row, figures)
    table1 = (out / "tables" / "table1.md").read_text()
    labels = {
        reproduction.PAPER_METHOD: "Qwen2.5-7B-Instruct + SEAL, as the paper describes it (no paper cell)",
        "qwen2.5-7b__vanilla_rl": "Qwen2.5-7B-Instruct + Vanilla RL",
        "toolace2-8b__seal": "ToolACE-2-Llama-3.1-8B + SEAL",
    }
    for row in CI_ROWS:  # best and last side by side, each with our numbers
        for which in ("best checkpoint", "last checkpoint, unbiased"):
            line = next(x for x in table1.splitlines() if x.startswith(f"| {labels[row]} ({which}) |"))
            assert not line.split(" | ")[1].startswith("–"), line
    ood = summary["runs"]["qwen2.5-7b__vanilla_rl__ood"]["ood_cells"]
    assert {"memory_kv", "memory_rec_sum"} <= set(ood)
    if tau2_python() is not None:
        assert {"tau2_retail", "tau2_airline", "tau2_telecom"} <= set(ood)


@pytest.mark.slow
def test_make_tables_reads_every_training_run_the_rehearsal_made(rehearsed):
    out, summary = rehearsed
    made = {p.name for p in (out / "runs").iterdir() if p.name.endswith("__training")}
    assert made == {f"{row}__training" for row in CI_ROWS}
    assert made <= set(summary["runs"]) and not summary["unreadable"]
    for name in made:
        assert summary["runs"][name]["step"] == 1, name  # its validation after its one step


@pytest.mark.slow
def test_a_checkpoint_scores_what_its_training_run_validated(rehearsed):
    """The rehearsal's seal.eval of each trained checkpoint against the run's own last validation, task by task."""
    out, _ = rehearsed
    val_file = str(REPO / reproduction.swap_values()["data.val_files"])
    for row in CI_ROWS:
        trained = load_run(str(out / "runs" / f"{row}__training"), step="last", val_file=val_file)
        for evaluation in (row, row + reproduction.LAST_SUFFIX):  # one step: the last checkpoint is the best
            evaluated = load_run(str(out / "runs" / evaluation))
            assert trained.verdicts and trained.verdicts == evaluated.verdicts, evaluation


@pytest.mark.slow
def test_checkpoint_eval_records_tables_and_rerun(rehearsed):
    """seal.eval checkpoint as the rehearsal ran it: one record per task, validation only, its table equal to the
    run's validation metrics and to bfcl-eval's own score; run again, it finds everything done and starts nothing."""
    out, _ = rehearsed
    row = out / "runs" / reproduction.PAPER_METHOD
    records = {r["task_id"]: r for r in load_records(str(row / "results.jsonl"))}
    assert sorted(records) == sorted(reproduction.heldout_ids())
    for r in records.values():
        assert not r["failed"], r["error"]
        assert r["source"]["mode"] == "checkpoint" and 1 <= r["model_calls"] <= 4
        assert r["tokens"]["prompt"] > 500 and r["tokens"]["completion"] > 0
        assert r["turns"][0] and all(step["reply"] for step in r["turns"][0]) and r["tags"]
    validation = validation_steps(read_metrics(str(row / "run")))
    assert list(validation) == [0]  # validation only, nothing trained
    table = json.loads((row / "table.json").read_text())["table"]
    assert {c: table[c]["accuracy"] for c in validation[0]} == validation[0]
    bfcl = json.loads((row / "bfcl" / "score.json").read_text())
    assert {c: s["correct_count"] for c, s in bfcl.items()} == {c: table[c]["passed"] for c in bfcl}
    step = next(s for s in reproduction.rehearsal(str(out), STUB) if s.kind == "eval" and s.row == row.name)
    again = subprocess.run([sys.executable, *step.argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "4 already in" in again.stdout and "ray init" not in again.stdout
