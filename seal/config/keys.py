"""Every key a recipe or an override names exists, or the run is refused naming the key, where it came from and
the nearest key that does exist (``did you mean seal.apatch.enable?``).

Hydra merges the files of a recipe's defaults list without checking their keys (a misspelt key becomes a new key
that nothing reads), and ``+key=value`` on the command line adds any key. Here every key of every file of a
recipe's defaults list (but the schema's own files) and of every override must be a key of the schema:

- the composed ``seal/config/schema.yaml``: verl's ``ppo_trainer`` and ``seal_defaults.yaml``;
- the fields of the dataclass that reads a block: verl's, named by the block's ``_target_`` (verl reads fields its
  YAML does not list, e.g. ``rollout.enable_sleep_mode``), and ours (:data:`READERS`);
- below a key of :data:`KEYED_MAPS`, the words of its vocabulary (the tags and labels);
- below a key of :data:`OPEN_MAPS`, anything: the free-form maps passed on as they are, each with why.

The schema is built once per process: one composition and a read of verl's config dataclasses' source (not an
import: verl's loads torch, seconds that a refused typo should not wait). A check after that is a set lookup,
:func:`unknown_keys` on a mapping or :func:`override_problems` on a command line.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent
#: The paper's recipes: after a recipe's own folder, where its defaults list looks (``defaults: [SEAL, _self_]``
#: works for a recipe kept anywhere).
RECIPES_DIR = CONFIG_DIR.parents[1] / "exp"
SCHEMA_CONFIG = "schema"


def searchpath() -> str:
    """Hydra's search path for a recipe, after the recipe's own folder: the paper's recipes, verl's trainer config
    (``ppo_trainer``) and seal's (``seal_defaults``, ``swap/``)."""
    from seal.config.checks import verl_config_dir

    return f"hydra.searchpath=[file://{RECIPES_DIR},file://{verl_config_dir()},pkg://seal.config]"


#: Free-form maps: any key below these passes. The value is why nothing here can list their keys.
OPEN_MAPS: dict[str, str] = {
    "actor_rollout_ref.rollout.engine_kwargs": "the rollout engine's own arguments (vLLM, SGLang, TensorRT-LLM), "
    "handed to it as they are",
    "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs": "the weight-sync backend's own arguments",
    "actor_rollout_ref.rollout.custom": "verl's slot for a custom rollout's own settings",
    "actor_rollout_ref.model.override_config": "merged into the model's Hugging Face config "
    "(attn_implementation, rope_scaling, ...): whatever that model's config class has",
    "actor_rollout_ref.actor.optim.override_optimizer_config": "the optimizer class's own keyword arguments",
    "critic.model.override_config": "as actor_rollout_ref.model.override_config, for the critic",
    "critic.optim.override_optimizer_config": "as actor_rollout_ref.actor.optim.override_optimizer_config",
    "data.apply_chat_template_kwargs": "the tokenizer's apply_chat_template arguments (e.g. enable_thinking)",
    "data.mm_processor_kwargs": "the multimodal processor's own arguments",
    "ray_kwargs.ray_init": "ray.init's keyword arguments (address, num_cpus, num_gpus, include_dashboard, "
    "runtime_env, ...)",
    "reward.reward_model.rollout.engine_kwargs": "the reward model's rollout engine's own arguments",
    "distillation.teacher_models": "teachers under names you choose, each read by verl's "
    "DistillationTeacherModelConfig when distillation is on",
    "distillation.teacher_models.teacher_model.inference.engine_kwargs": "the teacher's rollout engine's arguments",
    "trainer.v1.sampler.sampler_kwargs": "the custom sampler's own arguments",
    "global_profiler.global_tool_config.torch_memory.kw_args": "torch's memory profiler's own arguments",
    "seal.tiny_model.warm_start.decoys": "train task id -> texts: which tasks get decoys is the recipe's choice",
}


#: The keys verl's FSDP engine reads from a ``mixed_precision`` map (its dataclass types it as a plain dict).
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype")

#: Maps whose keys are words of a closed vocabulary: a key below them must be one (a misspelt tag is refused).
KEYED_MAPS: dict[str, str] = {
    "seal.apatch.tag_weights": "progress tags (env_service/vocabulary.py PROGRESS_TAGS)",
    "seal.apatch.label_weights": "paper labels (env_service/vocabulary.py LABELS)",
    "env_service.bfcl.capability_cues.guidelines": "progress tags and paper labels",
    **{
        f"{engine}.mixed_precision": "param_dtype, reduce_dtype, buffer_dtype: what verl's FSDP engine reads"
        for engine in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
    },
}


def _vocabularies() -> dict[str, tuple[str, ...]]:
    from env_service.vocabulary import LABELS, PROGRESS_TAGS

    words = {
        "seal.apatch.tag_weights": PROGRESS_TAGS,
        "seal.apatch.label_weights": LABELS,
        "env_service.bfcl.capability_cues.guidelines": tuple(dict.fromkeys((*PROGRESS_TAGS, *LABELS))),
    }
    return {key: words.get(key, MIXED_PRECISION_KEYS) for key in KEYED_MAPS}


def _readers() -> dict[str, Any]:
    """seal's blocks read by a dataclass: block -> a default instance (its fields, nested ones too, are the keys)."""
    from env_service.bfcl.config import EnvConfig, RewardConfig
    from seal.apatch import APatchConfig

    return {"env_service.bfcl": EnvConfig(), "seal.apatch": APatchConfig(), "seal.reward": RewardConfig()}


#: seal's blocks whose keys are those of the dataclass that reads them (besides what seal_defaults.yaml lists).
READERS = {
    "env_service.bfcl": "env_service.bfcl.config.EnvConfig",
    "seal.apatch": "seal.apatch.APatchConfig",
    "seal.reward": "env_service.bfcl.config.RewardConfig",
}
#: Reader fields that are not keys of the recipe, with why.
NOT_RECIPE_KEYS = {
    "env_service.bfcl.reward": "the reward is seal.reward, sent with every evaluation (EnvConfig carries it for "
    "the service's own callers)",
}


# ---- the schema -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schema:
    keys: frozenset[str]  # every key, inner ones too
    children: dict[str, tuple[str, ...]]  # key ("" for the root) -> the names below it
    vocabularies: dict[str, tuple[str, ...]]  # KEYED_MAPS with their words
    groups: tuple[str, ...]  # config groups a ``+group=option`` override may name (``swap``)

    def knows(self, key: str) -> bool:
        if key in self.keys:
            return True
        parent, _, name = key.rpartition(".")
        if parent in self.vocabularies:
            return name in self.vocabularies[parent]
        return any(key.startswith(open_map + ".") for open_map in OPEN_MAPS)

    def known_prefix(self, parts: list[str]) -> int:
        """How many leading parts of a key name keys of the schema."""
        for i in range(len(parts), 0, -1):
            if self.knows(".".join(parts[:i])):
                return i
        return 0

    def names_below(self, key: str) -> tuple[str, ...]:
        return self.vocabularies.get(key) or self.children.get(key, ())


@functools.cache
def schema_tree() -> dict:
    """``seal/config/schema.yaml`` composed (unresolved): every key of verl's ``ppo_trainer`` and of seal's."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from seal.config.checks import verl_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        composed = compose(config_name=SCHEMA_CONFIG, overrides=[f"hydra.searchpath=[file://{verl_config_dir()}]"])
    return OmegaConf.to_container(composed, resolve=False)


@functools.cache
def schema() -> Schema:
    """The schema: ``seal/config/schema.yaml`` composed, with the fields of the dataclasses that read its blocks."""
    tree = schema_tree()
    keys: set[str] = set()
    _collect(tree, "", keys)
    for key, target in _targets(tree, ""):
        keys.update(f"{key}.{name}" for name in verl_dataclass_fields(target))
    for block, instance in _readers().items():
        _collect(_fields_tree(instance), f"{block}.", keys)
    keys -= {k for k in keys for excluded in NOT_RECIPE_KEYS if k == excluded or k.startswith(excluded + ".")}
    children: dict[str, set[str]] = {}
    for key in keys:
        parent, _, name = key.rpartition(".")
        children.setdefault(parent, set()).add(name)
    return Schema(
        keys=frozenset(keys),
        children={parent: tuple(sorted(names)) for parent, names in children.items()},
        vocabularies=_vocabularies(),
        groups=tuple(sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and not p.name.startswith("_"))),
    )


def _collect(node: Any, prefix: str, keys: set[str]) -> None:
    if isinstance(node, dict):
        for name, value in node.items():
            keys.add(prefix + str(name))
            _collect(value, f"{prefix}{name}.", keys)


def _targets(node: Any, prefix: str) -> Iterable[tuple[str, str]]:
    """(key, dataclass path) of every block that names the dataclass verl reads it with."""
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield prefix.rstrip("."), node["_target_"]
        for name, value in node.items():
            yield from _targets(value, f"{prefix}{name}.")


def _fields_tree(instance: Any) -> dict:
    """A reader's fields as a tree: nested dataclass fields as mappings, the rest as leaves."""
    return {
        f.name: _fields_tree(getattr(instance, f.name)) if dataclasses.is_dataclass(getattr(instance, f.name)) else None
        for f in dataclasses.fields(instance)
        if not f.name.startswith("_")
    }


# ---- verl's config dataclasses, read from their source -----------------------------------------------------


def verl_dataclass_fields(target: str) -> tuple[str, ...]:
    """The init fields of verl's dataclass ``target`` (``verl.workers.config.RolloutConfig``) and its bases; () when
    it is not a dataclass found in verl's source."""
    module, _, name = target.rpartition(".")
    classes = _verl_classes(module)
    if name not in classes:
        return ()
    names: list[str] = []
    _class_fields(name, classes, names, set())
    return tuple(dict.fromkeys(names))


def _class_fields(name: str, classes: dict[str, ast.ClassDef], names: list[str], seen: set[str]) -> None:
    node = classes.get(name)
    if node is None or name in seen:
        return
    seen.add(name)
    for base in node.bases:
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if base_name:
            _class_fields(base_name, classes, names, seen)
    if not _is_dataclass(node):
        return
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        field_name = statement.target.id
        if field_name.startswith("_") or "ClassVar" in ast.unparse(statement.annotation):
            continue
        if isinstance(statement.value, ast.Call) and any(
            kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False
            for kw in statement.value.keywords
        ):
            continue
        names.append(field_name)


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        called = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (called.id if isinstance(called, ast.Name) else getattr(called, "attr", None)) == "dataclass":
            return True
    return False


@functools.cache
def _verl_classes(module: str) -> dict[str, ast.ClassDef]:
    """The classes of ``module``'s folder and of verl's ``base_config.py`` (where the bases live), by name."""
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    relative = Path(*module.split(".")[1:])
    folder = root / relative if (root / relative).is_dir() else (root / relative).parent
    classes: dict[str, ast.ClassDef] = {}
    for path in [root / "base_config.py", *sorted(folder.glob("*.py"))]:
        if path.is_file():
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, node)
    return classes


# ---- the checks ---------------------------------------------------------------------------------------------


def leaf_keys(tree: Any, prefix: str = "") -> list[str]:
    """Every leaf key of a mapping (an empty mapping is a leaf), dotted."""
    if not isinstance(tree, dict) or not tree:
        return [prefix.rstrip(".")] if prefix else []
    out = []
    for name, value in tree.items():
        out += leaf_keys(value, f"{prefix}{name}.")
    return out


def unknown_keys(keys: Iterable[str], origin: str) -> list[str]:
    """One line per key of ``keys`` that the schema does not have, naming ``origin`` and the nearest key; the keys
    below one unknown key are one line."""
    found = schema()
    problems: dict[str, list[str]] = {}
    for key in keys:
        if key.split(".")[0] == "hydra" or found.knows(key):  # Hydra's own settings: Hydra checks them
            continue
        parts = key.split(".")
        unknown = ".".join(parts[: found.known_prefix(parts) + 1])
        problems.setdefault(unknown, []).append(key)
    return [_describe(unknown, below, origin, found) for unknown, below in problems.items()]


def _describe(unknown: str, below: list[str], origin: str, found: Schema) -> str:
    key = below[0] if len(below) == 1 else unknown
    more = f" (and the {len(below)} keys below it)" if len(below) > 1 else ""
    parent = unknown.rpartition(".")[0]
    if parent and not found.names_below(parent):
        return f"{origin}: {key}{more}: {parent} takes a value, not keys"
    hint = nearest(key, found)
    return f"{origin}: {key}{more}: no such key" + (f"; did you mean {hint}?" if hint else "")


def nearest(key: str, found: Schema | None = None) -> str | None:
    """The existing key a misspelt ``key`` most likely means: its first unknown part corrected among the names at
    that place (with the rest of the key kept when that exists), else the same name elsewhere (a key put in the
    wrong block), else the closest key overall."""
    found = found or schema()
    parts = key.split(".")
    known = found.known_prefix(parts)
    prefix, wrong, rest = parts[:known], parts[known], parts[known + 1 :]
    for name in difflib.get_close_matches(wrong, found.names_below(".".join(prefix)), n=3, cutoff=0.6):
        whole = ".".join([*prefix, name, *rest])
        if found.knows(whole):
            return whole
    close = difflib.get_close_matches(wrong, found.names_below(".".join(prefix)), n=1, cutoff=0.6)
    if close:
        return ".".join([*prefix, close[0]])
    tail = "." + ".".join(parts[known:])
    elsewhere = sorted(k for k in found.keys if k.endswith(tail))
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(key, sorted(found.keys), n=1, cutoff=0.8)
    return close[0] if close else None


# ---- a recipe's files and overrides -------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A file of a recipe's defaults list: where it is and the key its content goes under (``''``: the root)."""

    path: Path
    package: str


def recipe_sources(recipe: Path, overrides: Iterable[str] = ()) -> list[Source]:
    """The files of ``recipe``'s defaults list (with its group overrides, ``+swap=cpu``) that are not the schema's
    own: the recipe, the recipes it includes, seal's swap files. Raises Hydra's errors for a defaults list that
    cannot be built."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    recipe = recipe.resolve()
    groups = schema().groups
    group_overrides = [o for o in overrides if override_key(o) in groups]
    with initialize_config_dir(config_dir=str(recipe.parent), version_base=None):
        loader = GlobalHydra.instance().config_loader()
        defaults = loader.compute_defaults_list(recipe.stem, [searchpath(), *group_overrides], RunMode.RUN).defaults
    sources = []
    for default in defaults:
        path = _source_file(default.config_path, recipe.parent)
        if path is not None:
            sources.append(Source(path, default.package or ""))
    return sources


def _source_file(config_path: str | None, recipe_dir: Path) -> Path | None:
    """The file of a defaults-list entry when it is checked: one beside the recipe, a paper recipe, or one of
    seal's config files (in the order of :func:`searchpath`); None for Hydra's, verl's and the schema's own."""
    if not config_path or config_path.startswith("hydra/"):
        return None
    for folder in (recipe_dir, RECIPES_DIR, CONFIG_DIR):
        path = folder / f"{config_path}.yaml"
        if path.is_file():
            schema_files = {CONFIG_DIR / "seal_defaults.yaml", CONFIG_DIR / f"{SCHEMA_CONFIG}.yaml"}
            return None if path.resolve() in schema_files else path.resolve()
    return None


def file_problems(source: Source) -> list[str]:
    """Unknown keys of one file of a defaults list (its ``defaults`` list aside)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.load(source.path), resolve=False) or {}
    tree.pop("defaults", None)
    prefix = f"{source.package}." if source.package else ""
    return unknown_keys([prefix + key for key in leaf_keys(tree)], _shown(source.path))


def override_key(override: str) -> str:
    """The key an override sets: ``+seal.apach.enable=false`` -> ``seal.apach.enable`` (``~key`` deletes it)."""
    return override.split("=", 1)[0].lstrip("+~")


def override_problems(overrides: Iterable[str]) -> list[str]:
    """Unknown keys of command-line overrides, ``+key=`` and ``++key=`` included (a group, ``+swap=cpu``, names a
    file that :func:`recipe_sources` lists). A mapping value (``+seal.apatch={enable: false}``) is checked key by
    key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    groups = schema().groups
    problems = []
    for override in overrides:
        key = override_key(override)
        if key in groups or key.split(".")[0] == "hydra":
            continue
        parsed = OverridesParser.create().parse_override(override)
        value = parsed.value() if not parsed.is_delete() else None
        keys = [f"{key}.{leaf}" for leaf in leaf_keys(value)] if isinstance(value, dict) and value else [key]
        problems += unknown_keys(keys, f"override {override}")
    return problems


def bad_overrides(overrides: Iterable[str]) -> list[str]:
    """The overrides :func:`override_problems` refuses (composition leaves them out to check the rest)."""
    return [o for o in overrides if override_problems([o])]


def recipe_key_problems(recipe: str | Path, overrides: Iterable[str] = ()) -> list[str]:
    """Every unknown key of a recipe's files and of its overrides, one line each."""
    overrides = list(overrides)
    problems = []
    for source in recipe_sources(Path(recipe), overrides):
        problems += file_problems(source)
    return problems + override_problems(overrides)


def _shown(path: Path) -> str:
    """A file as a user named it: relative to the current directory when it is below it."""
    try:
        return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    except ValueError:
        return str(path)
