"""Value checks of a composed recipe, before anything runs: every ``seal.*`` block, and the type of every key.

Hydra accepts any override whose key exists (``data.max_prompt_length=abc``, ``seal.apatch.apply_to=bogus``);
the value would surface much later, as a traceback in a Ray worker. Here:

- the type of every leaf is held to the type of its default (verl's generated ``ppo_trainer`` for verl's keys,
  ``seal_defaults.yaml`` for ours): a number or switch given as text, a switch given as a number, and for our
  keys a fraction where a count belongs (verl writes some fractional knobs with integer defaults, e.g.
  ``rollout.top_p: 1``, so for its keys any number passes where its default is an integer);
- each ``seal.*`` block is checked by the code that reads it (``seal.apatch`` by ``APatchConfig``,
  ``seal.reward`` by the environment's ``RewardConfig``) or by the ranges and choices listed here.

Each problem is one line naming the key, what it must be, and what was given.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

SEAL_DEFAULTS = Path(__file__).resolve().parent / "seal_defaults.yaml"

#: ``seal.*`` keys with a range or a set of values beyond their type: key -> (test, what it must be).
SEAL_RULES: dict[str, tuple[Any, str]] = {
    "rollout.max_model_calls": (lambda v: v >= 1, "an integer >= 1"),
    "rollout.max_env_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "rollout.max_tokens_per_call": (lambda v: v is None or v >= 1, "null or an integer >= 1"),
    "rollout.end_of_turn_token": (lambda v: bool(v), "a non-empty token"),
    "rollout.episode_retries": (lambda v: v >= 0, "an integer >= 0"),
    "validation.max_env_failure_share": (lambda v: 0.0 <= v <= 1.0, "a share between 0 and 1"),
    "validation.max_other_failure_share": (lambda v: 0.0 <= v <= 1.0, "a share between 0 and 1"),
    "checkpoint.best_mode": (lambda v: v in ("max", "min"), "max or min"),
    "checkpoint.best_metric": (lambda v: bool(v), "a metric name"),
    "debug.advantage_sign": (lambda v: v in (1, -1), "1 or -1"),
}


def verl_config_dir() -> Path:
    """verl's trainer config folder, found without importing verl (its import loads torch: seconds that a recipe
    refused for bad input should not wait)."""
    return Path(importlib.util.find_spec("verl").submodule_search_locations[0]) / "trainer" / "config"


@functools.cache
def _reference_leaves() -> dict[str, tuple[Any, bool]]:
    """(default value, whether an integer default means integers only) of every key: verl's generated trainer
    config, then seal's defaults (read, not resolved)."""
    verl_defaults = verl_config_dir() / "_generated_ppo_trainer.yaml"
    leaves: dict[str, tuple[Any, bool]] = {}
    for path, ours in ((verl_defaults, False), (SEAL_DEFAULTS, True)):
        found: dict[str, Any] = {}
        _flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=False), "", found)
        leaves.update({key: (value, ours) for key, value in found.items()})
    return leaves


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(value, f"{prefix}{key}.", out)
    else:
        out[prefix[:-1]] = node


def _type_problem(key: str, value: Any, default: Any, strict_int: bool) -> str | None:
    """A value whose type cannot be what the key's default says (nulls and interpolated defaults say nothing)."""
    if value is None or default is None or isinstance(default, str):
        return None
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int) and strict_int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, (int, float)):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    else:
        return None  # lists and mappings: their items are checked where they are read
    return None if ok else f"{key} must be {want} (like its default {json.dumps(default)}), got {value!r}"


def type_problems(config: DictConfig) -> list[str]:
    """Every resolved leaf of ``config`` whose type does not match its default's."""
    leaves: dict[str, Any] = {}
    _flatten(OmegaConf.to_container(config, resolve=True), "", leaves)
    reference = _reference_leaves()
    found = (_type_problem(key, value, *reference[key]) for key, value in leaves.items() if key in reference)
    return [problem for problem in found if problem]


def seal_block_problems(config: DictConfig) -> list[str]:
    """The ``seal.*`` blocks, each held to the values its reader accepts."""
    from env_service.bfcl.config import RewardConfig
    from seal.apatch import APatchConfig

    seal = OmegaConf.to_container(config.seal, resolve=True)
    problems = []
    for block, reader in (("apatch", APatchConfig), ("reward", RewardConfig)):
        try:
            reader.from_dict(seal.get(block), path=f"seal.{block}")
        except (ValueError, TypeError) as exc:  # the message names the key's path
            problems.append(str(exc))
    leaves: dict[str, Any] = {}
    _flatten(seal, "", leaves)
    problems += [problem for key in SEAL_RULES if key in leaves and (problem := rule_problem(key, leaves[key]))]
    return problems


def rule_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` for ``seal.<key>`` by its rule in ``SEAL_RULES``, or None; the one statement of
    the rule, for preflight and for a reader built without it (the trainer's parts in tests and rehearsals)."""
    test, want = SEAL_RULES[key]
    try:
        ok = bool(test(value))
    except TypeError:  # the type check names the type
        return None
    return None if ok else f"seal.{key} must be {want}, got {value!r}"


def value_problems(config: DictConfig) -> list[str]:
    """Type problems first (the block checks would only repeat them), then the ``seal.*`` blocks."""
    return type_problems(config) or seal_block_problems(config)
