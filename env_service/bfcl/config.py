"""The ``env_service.bfcl`` block of a recipe, as validated, immutable dataclasses.

The trainer sends this block (a plain dict) with every ``/create``; :meth:`EnvConfig.from_dict` turns it
into an :class:`EnvConfig`. Validation is strict on purpose: a misspelt switch (``observation_lite.enabel``)
would otherwise silently leave a feature off and change an experiment without anyone noticing. So an
unknown key raises ``ValueError`` naming the key and the allowed keys, and a value of the wrong type
raises ``ValueError`` naming the key, the expected type and what was given.

Defaults are the released environment's (the recipe turns ``observation_lite.enable`` on).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from env_service.bfcl.prompts import OBSERVATION_NOTE

#: ``tool_prompt_mode`` values. ``bfcl_qwen_fc``: bfcl's Qwen FC tool block (``<tool_call>`` JSON, the recipe).
#: ``toolace_llama``: bfcl's default prompting system prompt (what bfcl uses for ToolACE-2-8B); the model
#: answers with a Python call list ``[f(a=1), g(b="x")]`` (see ``parser.parse_python_calls``).
TOOL_PROMPT_MODES: tuple[str, ...] = ("bfcl_qwen_fc", "toolace_llama")

#: ``tool_result_mode`` values. ``bfcl_tool_response``: one user message of ``<tool_response>`` blocks (the released
#: environment's format). ``ipython``: one ``ipython``-role message per result, no wrapper — what bfcl's Llama handler
#: sends (ToolACE-2-8B).
TOOL_RESULT_MODES: tuple[str, ...] = ("bfcl_tool_response", "ipython")

#: ``reward.mode`` values: bfcl's pass/fail, and two partial-credit shapes (see :class:`RewardConfig`).
REWARD_MODES: tuple[str, ...] = ("binary", "capped", "t3rl")


class _Block:
    """Shared ``from_dict``/``to_dict`` for the frozen config dataclasses below.

    Each field's metadata carries its validator (see :func:`_opt`). Nested blocks are dataclasses with
    their own ``from_dict``.
    """

    @classmethod
    def from_dict(cls, data: Any, *, path: str = ""):
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"{path or cls.__name__}: expected a mapping, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = [key for key in data if key not in known]
        if unknown:
            where = f" in '{path}'" if path else ""
            raise ValueError(
                f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)}"
                f"{where}; allowed keys: {', '.join(sorted(known))}"
            )
        values = {}
        for key, value in data.items():
            check = known[key].metadata["check"]
            values[key] = check(value, f"{path}.{key}" if path else key)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, _Block):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    def replace(self, **changes):
        """A copy with some fields changed (validated like ``from_dict``)."""
        merged = self.to_dict()
        merged.update(changes)
        return type(self).from_dict(merged)


# ----------------------------------------------------------------------------------------------
# Validators. Each takes (value, key path) and returns the normalised value or raises ValueError.
# ----------------------------------------------------------------------------------------------


def _type_error(key: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"config key '{key}': expected {expected}, got {type(value).__name__} {value!r}")


def _bool(value: Any, key: str) -> bool:
    # bool only: 0/1 or "true" are almost always a templating mistake in a recipe.
    if not isinstance(value, bool):
        raise _type_error(key, "a boolean", value)
    return value


def _int(minimum: int | None = None):
    def check(value: Any, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, "an integer", value)
        if minimum is not None and value < minimum:
            raise ValueError(f"config key '{key}': must be >= {minimum}, got {value}")
        return value

    return check


def _float(lo: float | None = None, hi: float | None = None):
    def check(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(key, "a number", value)
        value = float(value)
        if value != value:  # NaN would make every threshold comparison false
            raise ValueError(f"config key '{key}': must not be NaN")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"config key '{key}': must be within [{lo}, {hi}], got {value}")
        return value

    return check


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _type_error(key, "a string", value)
    return value


def _choice(choices: tuple[str, ...]):
    def check(value: Any, key: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"config key '{key}': expected one of {', '.join(choices)}; got {value!r}")
        return value

    return check


def _categories(value: Any, key: str) -> tuple[str, ...] | None:
    """None (all categories), one name, or a list of names (``base`` or ``multi_turn_base`` both work)."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise _type_error(key, "null, a string or a list of strings", value)


def _guidelines(value: Any, key: str) -> dict[str, str | None] | None:
    """Per-tag guideline overrides for capability cues: text replaces ours, null removes the tag."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error(key, "null or a mapping tag -> text|null", value)
    for tag, text in value.items():
        if not isinstance(tag, str) or not (text is None or isinstance(text, str)):
            raise ValueError(f"config key '{key}': entries must be tag -> text or null, got {tag!r}: {text!r}")
    return dict(value)


def _block(cls):
    def check(value: Any, key: str):
        return cls.from_dict(value, path=key)

    return check


def _opt(default: Any, check) -> Any:
    """A dataclass field with a default and the validator ``from_dict`` applies to it."""
    if isinstance(default, (dict, list)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: default, metadata={"check": check})
    return field(default=default, metadata={"check": check})


# ----------------------------------------------------------------------------------------------
# The blocks
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObservationLiteConfig(_Block):
    """Schema cues on the tool docs shown in the system prompt (train-only by default)."""

    enable: bool = _opt(False, _bool)
    apply_to_validation: bool = _opt(False, _bool)
    add_required_hint: bool = _opt(True, _bool)
    add_type_hint: bool = _opt(False, _bool)
    add_enum_hint: bool = _opt(True, _bool)
    hide_optional: bool = _opt(False, _bool)
    categories: tuple[str, ...] | None = _opt(None, _categories)
    instruction: str = _opt(OBSERVATION_NOTE, _str)


@dataclass(frozen=True)
class ToolFeedbackConfig(_Block):
    """``tool_feedback_evolution``: recovery hints after parse errors and tool errors."""

    enable: bool = _opt(False, _bool)
    apply_to_validation: bool = _opt(False, _bool)
    categories: tuple[str, ...] | None = _opt(None, _categories)
    max_tool_names: int = _opt(12, _int(minimum=0))


@dataclass(frozen=True)
class CapabilityCuesConfig(_Block):
    """``diagnostic_evolution``: guideline lines chosen from the trainer's failure profile."""

    enable: bool = _opt(False, _bool)
    apply_to_validation: bool = _opt(False, _bool)
    categories: tuple[str, ...] | None = _opt(None, _categories)
    min_tag_count: int = _opt(8, _int(minimum=0))
    prevalence_threshold: float = _opt(0.10, _float(0.0, 1.0))
    reward_threshold: float = _opt(0.6, _float())
    max_lines: int = _opt(3, _int(minimum=0))
    per_category: bool = _opt(False, _bool)
    guidelines: dict[str, str | None] | None = _opt(None, _guidelines)


@dataclass(frozen=True)
class RewardConfig(_Block):
    """The trajectory reward: the recipe's ``reward`` block, the trainer's ``seal.reward`` sent with each
    ``/evaluate``, and what the verifier scores with. ``binary``: BFCL pass/fail (vanilla RL and, with
    cap 0, SEAL).

    ``capped``: 1.0 on pass, else min(partial_credit_cap, partial_credit_weight * progress), clamped to [0, 1].
    ``t3rl``: 1.0 on pass, else (passed + w*passed_irr) / (scorable + w*irr), w = irrelevance_weight.

    :meth:`from_dict` (requests, recipes) holds values to their ranges; built directly (tests, the
    verifier's callers) only the mode and finite numbers are required, out-of-range values are clamped.
    """

    mode: str = _opt("binary", _choice(REWARD_MODES))
    partial_credit_cap: float = _opt(0.7, _float(0.0, 1.0))
    partial_credit_weight: float = _opt(1.0, _float(0.0))
    irrelevance_weight: float = _opt(0.5, _float(0.0))
    scorable_floor: bool = _opt(False, _bool)

    def __post_init__(self) -> None:
        if self.mode not in REWARD_MODES:
            raise ValueError(f"unknown reward mode {self.mode!r}; expected one of {REWARD_MODES}")
        for name in ("partial_credit_cap", "partial_credit_weight", "irrelevance_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class EnvConfig(_Block):
    """The whole ``env_service.bfcl`` block."""

    strict_tool_parser: bool = _opt(True, _bool)
    enforce_available_tools: bool = _opt(True, _bool)
    tool_prompt_mode: str = _opt("bfcl_qwen_fc", _choice(TOOL_PROMPT_MODES))
    tool_result_mode: str = _opt("bfcl_tool_response", _choice(TOOL_RESULT_MODES))
    observation_lite: ObservationLiteConfig = _opt(ObservationLiteConfig(), _block(ObservationLiteConfig))
    tool_feedback_evolution: ToolFeedbackConfig = _opt(ToolFeedbackConfig(), _block(ToolFeedbackConfig))
    capability_cues: CapabilityCuesConfig = _opt(CapabilityCuesConfig(), _block(CapabilityCuesConfig))
    reward: RewardConfig = _opt(RewardConfig(), _block(RewardConfig))


@dataclass(frozen=True)
class ServiceLimits(_Block):
    """What one episode and one client may cost the service (``python -m env_service serve`` flags).

    Budgets are wall-clock seconds of backend work, enforced inside the worker processes (a call over its
    budget is interrupted; a worker that does not answer within its budget plus ``worker_grace_s`` is
    killed and replaced). Defaults sit far above anything the ground truth or a sane model needs: the
    slowest ground-truth call takes milliseconds, the largest ground-truth reply is 31 KB, a ground-truth
    turn has at most 34 calls and the largest backend state is 27 KB.
    """

    call_budget_s: float = _opt(2.0, _float(0.001))
    message_budget_s: float = _opt(5.0, _float(0.001))
    evaluate_budget_s: float = _opt(10.0, _float(0.001))
    worker_grace_s: float = _opt(5.0, _float(0.0))
    # What one episode's replay on a replacement worker may take beyond twice its own recorded cost (the worker time
    # its create and accepted messages took); each episode has its own, whatever the others on the worker cost.
    replay_budget_s: float = _opt(30.0, _float(0.0))
    # How long a request waits behind another episode's request running on its worker (a message may run its whole
    # budget) before its episode is moved to a calm worker, by a replay; 0: never moved (env_service.workers.pool).
    move_after_s: float = _opt(0.25, _float(0.0))
    call_memory_mib: int = _opt(256, _int(minimum=1))  # resident memory one call may add
    worker_memory_mib: int = _opt(4096, _int(minimum=0))  # address-space cap per worker; 0: none
    max_steps: int = _opt(100, _int(minimum=1))
    # CPU seconds all of one episode's messages may use together (reading them and running their calls), however
    # cheap each is: beyond, the next message gets a limit text and the episode ends. A ground-truth episode uses well
    # under 0.1 s; without it one episode could use max_steps x message_budget_s (500 s) of a worker.
    episode_cpu_budget_s: float = _opt(30.0, _float(0.001))
    max_calls_per_message: int = _opt(64, _int(minimum=1))
    max_reply_bytes: int = _opt(128 * 1024, _int(minimum=256))
    max_errors_per_message: int = _opt(8, _int(minimum=1))  # parse errors shown and kept per message
    # What one episode keeps between messages (records: accepted calls' arguments, kept results, errors,
    # its prompt), measured like the state (env_service.sizes.measured_bytes); beyond it the episode ends with a text.
    max_episode_bytes: int = _opt(16 * 1024 * 1024, _int(minimum=64 * 1024))
    max_state_bytes: int = _opt(8 * 1024 * 1024, _int(minimum=1024))
    # What all the live episodes of one client keep together (a client is its address, ``peer_key``, whatever run ids
    # it names: limits that protect other clients cannot be multiplied by minting run ids): their records and last
    # measured states in the workers, and their messages in the service (kept to rebuild them after a worker loss).
    # Beyond it the client's steps and creates are refused until it releases episodes; one client then stays well
    # inside a worker's worker_memory_mib (a ground-truth episode keeps 100 KB at most).
    max_owner_bytes: int = _opt(1024 * 1024 * 1024, _int(minimum=1024 * 1024))
    max_episodes: int = _opt(4096, _int(minimum=1))
    max_episodes_per_owner: int = _opt(1024, _int(minimum=1))  # live episodes of one client (all its run ids)
    # Verdicts of released episodes kept for a retried evaluate (its first answer lost), each for 10 minutes: at most
    # evaluations_kept_per_client of one client, evaluations_kept of all together (beyond, the oldest verdict of the
    # client keeping the most goes), so a client finishing thousands of episodes evicts its own verdicts, not others'.
    evaluations_kept_per_client: int = _opt(2048, _int(minimum=1))
    evaluations_kept: int = _opt(4096, _int(minimum=1))
    # The same verdicts in bytes (kept as their JSON, measured): a ground-truth verdict is ~2 KB, so 2,048 of a client
    # keep ~4 MiB; an OOD memory prerequisite's carries its snapshot (up to 1 MiB), so a client keeps 64 of those.
    evaluation_bytes_kept_per_client: int = _opt(64 * 1024 * 1024, _int(minimum=1024 * 1024))
    evaluation_bytes_kept: int = _opt(256 * 1024 * 1024, _int(minimum=1024 * 1024))
    # Failure profiles of the runs of one client, and of all runs, in bytes (kept as their JSON): at most 1 MiB each
    # (manager.MAX_PROFILE_BYTES), so a client's 16 run ids fit, and the 64 runs kept at once.
    profile_bytes_kept_per_client: int = _opt(16 * 1024 * 1024, _int(minimum=1024 * 1024))
    profile_bytes_kept: int = _opt(64 * 1024 * 1024, _int(minimum=1024 * 1024))
    idle_timeout_s: float = _opt(600.0, _float(0.0))
    reclaim_interval_s: float = _opt(15.0, _float(0.01))


__all__ = [
    "OBSERVATION_NOTE",
    "REWARD_MODES",
    "TOOL_PROMPT_MODES",
    "TOOL_RESULT_MODES",
    "CapabilityCuesConfig",
    "EnvConfig",
    "ObservationLiteConfig",
    "RewardConfig",
    "ServiceLimits",
    "ToolFeedbackConfig",
]
