"""The paper's reproduction plan and its CPU rehearsal (``scripts/reproduce.py``, ``seal/reproduction.py``).

The plan names a command for every cell of Table 1, the ablation and the OOD table; a rehearsal command differs
from its plan command only by the swap (``seal/config/swap/cpu.yaml``) and the documented command-line swaps; the
rehearsal itself (slow) runs the chain on CPU and ends in the tables and figures, built from every run it made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from seal import paper_numbers as paper
from seal import reproduction
from seal.launch import compose_recipe
from seal.memory_estimate import model_shape

REPO = Path(__file__).resolve().parents[1]
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
    assert rows_of(plan, "ood") == {make_tables.row_key(b, t) for b, t in paper.TABLE1}
    assert {s.row for s in plan if s.kind == "ood" and "--user-endpoint" in s.argv} == rows_of(plan, "ood")  # tau2


def test_the_plan_trains_before_it_evaluates_and_tabulates_last(plan):
    position = {(s.kind, s.row): i for i, s in enumerate(plan)}
    for row in rows_of(plan, "train"):
        assert position[("train", row)] < position[("eval", row)]
    assert plan[-1].kind == "tables" and [s.kind for s in plan].count("tables") == 1
    trained = rows_of(plan, "train")
    assert trained == {r for r in rows_of(plan, "eval") if not r.endswith("__base")}


def test_every_paper_recipe_trains_a_row(plan):
    recipes = {s.recipe for s in plan if s.kind == "train"}
    paper_recipes = {f"exp/{n}.yaml" for n in ("SEAL", "vanilla_rl", "qwen2.5_3b", "toolace2_8b", *reproduction.ABLATIONS)}
    assert paper_recipes <= recipes


def leaves(config) -> dict:
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(config), "")
    return flat


def overrides(step) -> list[str]:
    """The Hydra overrides of a launcher or seal.eval command (after --conf RECIPE, or after --)."""
    argv = step.argv
    tail = argv[argv.index("--") + 1 :] if "--" in argv else argv[argv.index(step.recipe) + 1 :]
    return [a for a in tail if "=" in a and not a.startswith("--")]


def test_vanilla_rl_on_another_backbone_is_vanilla_rl_with_that_backbone(plan):
    by_row = {s.row: s for s in plan if s.kind == "train"}
    vanilla = leaves(compose_recipe(str(REPO / "exp/vanilla_rl.yaml")))
    for backbone in ("qwen2.5-3b", "toolace2-8b"):
        step = by_row[f"{backbone}__vanilla_rl"]
        ours = leaves(compose_recipe(str(REPO / step.recipe), overrides(step)))
        seal = leaves(compose_recipe(str(REPO / step.recipe)))
        backbone_keys = {k for k in seal if seal[k] != leaves(compose_recipe(str(REPO / "exp/SEAL.yaml"))).get(k)}
        differs = {k for k in ours if ours[k] != vanilla.get(k)} - backbone_keys
        assert differs <= {"trainer.experiment_name", "seal.run_dir", "trainer.default_local_dir"}, differs


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
    for step in rehearsal:
        gpu = planned[(step.kind, step.row)]
        ours, theirs = flag_values(step.argv), flag_values(gpu.argv)
        flags = {f for f in ours.keys() | theirs.keys() if ours.get(f) != theirs.get(f)}
        assert flags <= set(reproduction.COMMAND_SWAPS[step.kind]), (step.row, flags)
        if step.kind in ("train", "eval"):
            ours = leaves(compose_recipe(str(REPO / step.recipe), overrides(step)))
            theirs = leaves(compose_recipe(str(REPO / gpu.recipe), overrides(gpu)))
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


def test_gpu_hours_follow_the_recipes_sizes_by_hand():
    config = compose_recipe(str(REPO / "exp/SEAL.yaml"))
    found = reproduction.cost(config, "train")
    steps = 6 * (400 // 32)  # 6 epochs of 12 full batches of 32 tasks
    validations = 1 + 7 + 1  # before training, at steps 10..70, after the last (72)
    episodes, val_episodes = steps * 32 * 8, validations * 400
    sequence = 0.5 * 16384
    parameters = model_shape("Qwen/Qwen2.5-7B-Instruct")[0].parameters
    train_s = episodes * sequence * parameters * 10 / (989e12 * 0.3)
    decode_s = (episodes + val_episodes) * sequence * 0.25 / (2000 * 7.6e9 / parameters)
    assert (found.steps, found.train_episodes, found.val_episodes, found.gpus) == (72, episodes, val_episodes, 4)
    assert found.gpu_hours == pytest.approx((train_s + decode_s) / 3600)
    half = reproduction.cost(compose_recipe(str(REPO / "exp/SEAL.yaml"), ["trainer.total_epochs=3"]), "train")
    assert half.steps == 36 and half.gpu_hours < found.gpu_hours


def test_plan_prints_every_command_with_its_cost():
    done = subprocess.run(
        [sys.executable, "scripts/reproduce.py", "--plan", "--out", "X"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for step in reproduction.plan("X"):
        assert step.command() in done.stdout
    assert done.stdout.count("GPU-hours on 4 GPU(s)") == len([s for s in reproduction.plan("X") if s.kind != "serve"]) - (
        len([s for s in reproduction.plan("X") if s.kind in ("ood", "tables")])
    )


def test_an_unknown_row_is_refused_in_one_line():
    done = subprocess.run(
        [sys.executable, "scripts/reproduce.py", "--rehearse", "--rows", "qwen2.5-7b__sael"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "unknown rows" in done.stderr and "Traceback" not in done.stderr


# ---- the rehearsal, end to end ---------------------------------------------------------------------

#: The rows CI rehearses: every paper recipe trained once (SEAL, Vanilla RL, the three ablations, the 3B and the
#: ToolACE backbones) and a base model of each prompt format; every join of the chain is walked.
CI_ROWS = (
    "qwen2.5-7b__seal",
    "qwen2.5-7b__vanilla_rl",
    "qwen2.5-3b__seal",
    "toolace2-8b__seal",
    "toolace2-8b__base",
    *reproduction.ABLATIONS,
)


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    out = tmp_path_factory.mktemp("rehearsal")
    done = subprocess.run(
        [sys.executable, "scripts/reproduce.py", "--rehearse", "--out", str(out), "--rows", ",".join(CI_ROWS)]
        + ["--jobs", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, done.stdout


@pytest.mark.slow
def test_the_rehearsal_ends_in_the_papers_tables_and_figures(rehearsed):
    out, _ = rehearsed
    for name in ("table1.md", "ablation.md", "ood.md", "interaction.md", "accuracy_over_steps.png"):
        assert (out / "tables" / name).stat().st_size > 0, name
    table1 = (out / "tables" / "table1.md").read_text()
    assert "ToolACE-2-Llama-3.1-8B base model" in table1
    for row in CI_ROWS:
        if not row.endswith("__base"):
            figures = {p.name for p in (out / "runs" / f"{row}__training").glob("*.png")}
            assert {"accuracy_bands.png", "tag_shares.png"} <= figures, (row, figures)


@pytest.mark.slow
def test_make_tables_reads_every_training_run_the_rehearsal_made(rehearsed):
    out, _ = rehearsed
    summary = json.loads((out / "tables" / "tables.json").read_text())
    made = {p.name for p in (out / "runs").iterdir() if p.name.endswith("__training")}
    assert made == {f"{r}__training" for r in CI_ROWS if not r.endswith("__base")}
    assert made <= set(summary["runs"]) and not summary["unreadable"]
    for name in made:
        assert summary["runs"][name]["step"] == 1  # its validation after the one step
    evaluated = {r for r in CI_ROWS}
    assert evaluated <= set(summary["runs"])
    ood = summary["runs"]["qwen2.5-7b__seal__ood"]["ood_cells"]
    assert {"memory_kv", "memory_rec_sum"} <= set(ood)
