"""A misspelt key is refused before anything starts, naming the key, where it came from and the key it meant
(``seal/config/keys.py``): in a recipe's files, on the command line (``+key=`` too), in every key of every recipe."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from seal.config import keys
from seal.config.keys import OPEN_MAPS, Source, file_problems, leaf_keys, recipe_key_problems, unknown_keys
from seal.launch.cli import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "exp").glob("*.yaml"))
SWAP = ROOT / "seal" / "config" / "swap" / "cpu.yaml"

TYPOS = "defaults:\n  - cpu_tiny\n  - _self_\nseal:\n  apach:\n    enable: false\ntrainer:\n  total_epoch: 3\n"


def test_typos_in_a_recipe_file_fail_the_dry_run_naming_each_key_its_file_and_the_key_meant(tmp_path, capsys):
    recipe = tmp_path / "ablation.yaml"  # a recipe of one's own, kept outside exp/, built on a paper recipe
    recipe.write_text(TYPOS)
    assert main(["--conf", str(recipe), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert f"{recipe}: seal.apach.enable: no such key; did you mean seal.apatch.enable?" in err, err
    assert f"{recipe}: trainer.total_epoch: no such key; did you mean trainer.total_epochs?" in err, err
    assert "[seal] recipe " in out and "disk at peak" in out  # and what the run would be, all the same


def test_a_plus_override_of_a_misspelt_key_is_refused_before_anything_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["--conf", str(ROOT / "exp" / "cpu_tiny.yaml"), f"seal.run_dir={run_dir}"]
    assert main([*argv, "+seal.apach.enable=false", "++trainer.total_epoch=3"]) == 2
    out, err = capsys.readouterr()
    assert "override +seal.apach.enable=false: seal.apach.enable: no such key; did you mean seal.apatch.enable?" in err
    assert (
        "override ++trainer.total_epoch=3: trainer.total_epoch: no such key; did you mean trainer.total_epochs?" in err
    )
    assert not out and not run_dir.exists()  # nothing built, no service, no Ray


def test_keys_verl_reads_but_its_yaml_omits_and_open_maps_pass_and_their_typos_do_not():
    seal = ROOT / "exp" / "SEAL.yaml"
    fine = [
        "+actor_rollout_ref.rollout.enable_sleep_mode=false",  # RolloutConfig's field, not in rollout.yaml
        "+actor_rollout_ref.model.override_config.rope_scaling.factor=2",  # open: the model's HF config
        "+ray_kwargs.ray_init.include_dashboard=false",  # open: ray.init's arguments
        "seal.apatch.tag_weights.budget_exceeded=1.5",  # a progress tag the defaults do not weigh
        "+env_service.bfcl.observation_lite.instruction=Mind the schema.",  # EnvConfig's field
        "+swap=cpu",  # a config group, not a key
        "hydra.job.chdir=false",  # Hydra's own
    ]
    assert recipe_key_problems(seal, fine) == []
    refused = {
        "+actor_rollout_ref.rollout.enable_sleep_mod=false": "actor_rollout_ref.rollout.enable_sleep_mode",
        "seal.apatch.tag_weights.state_mismach=2": "seal.apatch.tag_weights.state_mismatch",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtyp=bf16": (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
        ),
        "+trainer.max_prompt_length=2048": "data.max_prompt_length",  # the right key in the wrong block
        "+seal.apatch={enabel: false}": "seal.apatch.enable",  # a mapping value, key by key
    }
    for override, meant in refused.items():
        problems = recipe_key_problems(seal, [override])
        assert len(problems) == 1 and problems[0].endswith(f"did you mean {meant}?"), (override, problems)
    problems = recipe_key_problems(seal, ["+env_service.bfcl.reward.mode=capped"])  # seal.reward is the reward
    assert len(problems) == 1 and "env_service.bfcl.reward.mode: no such key" in problems[0], problems
    problems = recipe_key_problems(seal, ["+trainer.total_epochs.n=1"])
    assert problems == [
        "override +trainer.total_epochs.n=1: trainer.total_epochs.n: trainer.total_epochs takes a value, not keys"
    ]


def test_the_overrides_seal_eval_checkpoint_passes_name_keys_of_every_recipe(tmp_path):
    """``seal.tiny_model.build=false`` is a key of every recipe now (seal_defaults has the block): on main it failed
    to compose on a GPU recipe, so ``seal.eval checkpoint --model M`` could not run exp/SEAL.yaml at all."""
    from seal.eval.checkpoint import eval_overrides
    from seal.launch.recipe import compose_recipe

    model = tmp_path / "model"
    model.mkdir()
    overrides = eval_overrides(str(model), str(tmp_path / "tasks.parquet"), str(tmp_path / "r.jsonl"), str(tmp_path))
    for recipe in ("SEAL.yaml", "cpu_tiny.yaml"):
        assert recipe_key_problems(ROOT / "exp" / recipe, overrides) == []
        assert compose_recipe(str(ROOT / "exp" / recipe), overrides).seal.tiny_model.build is False


# ---- every key of every recipe -------------------------------------------------------------------------------


def recipe_files() -> list[Path]:
    return [*RECIPES, SWAP]


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: p.stem)
def test_every_recipe_file_names_only_keys_that_exist(path):
    assert file_problems(Source(path, "")) == []


def key_paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of a recipe file, inner ones too, as paths (its defaults list aside)."""
    out = []
    for name, value in tree.items():
        if not prefix and name == "defaults":
            continue
        out.append((*prefix, str(name)))
        if isinstance(value, dict):
            out += key_paths(value, (*prefix, str(name)))
    return out


def misspelt(name: str, siblings: set[str]) -> str:
    """``name`` with one letter changed (the middle one, else another), into a name that is no sibling's."""
    for i in [len(name) // 2, *range(len(name))]:
        for letter in "xq":
            typo = name[:i] + letter + name[i + 1 :]
            if typo != name and typo not in siblings:
                return typo
    raise AssertionError(name)


def with_key_renamed(tree: dict, path: tuple[str, ...], new: str) -> dict:
    changed = copy.deepcopy(tree)
    node = changed
    for name in path[:-1]:
        node = node[name]
    node[new] = node.pop(path[-1])
    return changed


def test_the_check_refuses_every_key_of_every_recipe_misspelt_by_one_letter():
    """Each key of each recipe file (every level), one letter changed: the check refuses it, names the changed
    key, and for a key of four letters or more (too short to tell from its neighbours otherwise) suggests the key it
    was. Keys inside an open map (``keys.OPEN_MAPS``: a model's own config, ...) are free-form, so not mutated.
    In-process: the check itself, not a dry run per key."""
    checked = 0
    for path in recipe_files():
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        for key_path in key_paths(tree):
            if any(".".join(key_path).startswith(open_map + ".") for open_map in OPEN_MAPS):
                continue
            parent = tree
            for name in key_path[:-1]:
                parent = parent[name]
            typo = misspelt(key_path[-1], set(parent))
            mutated = with_key_renamed(tree, key_path, typo)
            mutated.pop("defaults", None)
            problems = unknown_keys(leaf_keys(mutated), str(path))
            wrong = ".".join((*key_path[:-1], typo))
            assert len(problems) == 1 and f": {wrong}" in problems[0], (path.name, key_path, problems)
            if len(key_path[-1]) >= 4:
                original = ".".join(key_path)
                assert f"did you mean {original}" in problems[0], (path.name, key_path, problems)
            checked += 1
    assert checked > 300  # every level of every file, not a handful


# ---- the schema's own lists stay true ------------------------------------------------------------------------


def empty_maps(tree: dict, prefix: str = "") -> set[str]:
    found = set()
    for name, value in tree.items():
        if isinstance(value, dict):
            found |= empty_maps(value, f"{prefix}{name}.") if value else {prefix + name}
    return found


def test_every_empty_map_of_the_schema_is_open_or_keyed_and_every_listed_map_exists():
    schema = keys.schema()
    empty = empty_maps(keys.schema_tree()) - set(keys.KEYED_MAPS)
    closed = {"trainer.v1.sync": "verl's sync mode takes no options"}
    assert {k for k in empty if not any(k == m or k.startswith(m + ".") for m in OPEN_MAPS)} - set(closed) == set()
    assert [k for k in [*OPEN_MAPS, *keys.KEYED_MAPS] if k not in schema.keys] == []


def test_seal_defaults_lists_every_key_its_readers_read_and_nothing_they_do_not():
    """seal's blocks read by a dataclass (``keys.READERS``): seal_defaults.yaml has each of its keys (so the
    generated docs/recipes.md shows them with a default and a comment), and no key the reader would refuse."""
    defaults = OmegaConf.to_container(OmegaConf.load(ROOT / "seal" / "config" / "seal_defaults.yaml"))
    reader_only = {"env_service.bfcl.observation_lite.instruction": "its default is the note's whole text"}
    for block, reader in keys._readers().items():
        node = defaults
        for name in block.split("."):
            node = node[name]
        listed = {f"{block}.{k}" for k in leaf_keys(node)}
        read = {f"{block}.{k}" for k in leaf_keys(keys._fields_tree(reader))}
        read = {k for k in read if not any(k.startswith(excluded + ".") for excluded in keys.NOT_RECIPE_KEYS)}
        listed_maps = {k.rsplit(".", 1)[0] for k in listed if k.rsplit(".", 1)[0] in keys.KEYED_MAPS}
        assert {k for k in listed if k.rsplit(".", 1)[0] not in listed_maps} - read == set(), block
        assert read - listed - listed_maps - set(reader_only) == set(), block
