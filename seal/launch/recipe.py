"""A recipe: composed from its files and overrides, its keys checked against the schema, and prepared for a run.

A recipe is a Hydra config whose defaults are verl's ``ppo_trainer`` and ``seal_defaults``; the search path for
both and for the paper's recipes in ``exp/`` is supplied here, so a recipe kept anywhere can build on one
(``defaults: [SEAL, _self_]``). Every key of the recipe's files and of the overrides must exist
(``seal/config/keys.py``). ``prepare`` materialises what the composed recipe needs before the checks against the
node and the run: the CPU recipes' tiny model, the agent-loop registration, absolute paths for other nodes.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import DictConfig, open_dict

#: The checkout the recipes (``exp/``) and the service's entry point are found in.
REPO_ROOT = Path(__file__).resolve().parents[2]
AGENT_LOOPS_YAML = REPO_ROOT / "seal" / "config" / "agent_loops.yaml"
AGENT_LOOP_MANAGER = "seal.failed_episodes.SealAgentLoopManager"


class PreflightError(ValueError):
    """A configuration that cannot run, with what to change."""


def compose_recipe(conf: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The recipe file ``conf`` composed with ``overrides`` (Hydra, with verl's and seal's configs on its search
    path); a missing file or one that is not YAML is a ``PreflightError``."""
    from hydra import compose, initialize_config_dir

    from seal.config.keys import searchpath

    path = _recipe_file(conf)
    try:
        with initialize_config_dir(config_dir=str(path.resolve().parent), version_base=None):
            return compose(config_name=path.stem, overrides=[searchpath(), *overrides])
    except yaml.YAMLError as exc:  # the recipe or one it includes
        raise PreflightError(f"recipe {_yaml_problem(exc)}") from None


def check_keys(conf: str, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every key of the recipe's files and of the overrides, against the schema (``seal/config/keys.py``): one line
    per unknown key with where it came from and the nearest key. Before anything is composed from them."""
    from seal.config.keys import recipe_key_problems

    _recipe_file(conf)
    try:
        return recipe_key_problems(conf, overrides)
    except yaml.YAMLError as exc:  # the recipe or one it includes
        raise PreflightError(f"recipe {_yaml_problem(exc)}") from None


def _recipe_file(conf: str) -> Path:
    path = Path(conf)
    if not path.is_file():
        raise PreflightError(f"recipe {conf!r} not found (recipes live in exp/, e.g. exp/SEAL.yaml)")
    return path


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "(position unknown)"
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    return f"{where}: not valid YAML: {problem}"


def prepare(config: DictConfig) -> DictConfig:
    """Materialise what the recipe needs, in place: the offline tiny model (CPU recipes, optionally warm-started:
    ``seal/cpu/warm_start.py``), the agent-loop registration and absolute paths; returns ``config``."""
    from seal.cpu.warm_start import build_recipe_model
    from seal.launch.multinode import absolute_paths

    build_recipe_model(config)
    agent = config.actor_rollout_ref.rollout.agent
    if not agent.agent_loop_config_path:
        # verl's AgentLoopWorker reads this list and registers `seal_bfcl` in every agent-loop process.
        agent.agent_loop_config_path = str(AGENT_LOOPS_YAML)
    if not agent.get("agent_loop_manager_class"):
        with open_dict(agent):  # verl's field, absent from its YAML: a step where every episode failed still runs
            agent.agent_loop_manager_class = AGENT_LOOP_MANAGER
    absolute_paths(config)  # workers on other nodes get this config, not this working directory
    return config
