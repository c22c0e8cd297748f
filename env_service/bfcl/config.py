"""The ``env_service.bfcl`` block of a recipe, as validated, immutable dataclasses.

The trainer sends this block (a plain dict) with every ``/create``; :meth:`EnvConfig.from_dict` turns it
into an :class:`EnvConfig`, strictly (``env_service/config_blocks.py``: an unknown key or a value of the wrong type
is a ``ValueError`` that names it).

Defaults are the released environment's (the recipe turns ``observation_lite.enable`` on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from env_service.bfcl.prompts import OBSERVATION_NOTE
from env_service.config_blocks import (
    ConfigBlock,
    block,
    boolean,
    choice,
    integer,
    key_error,
    number,
    setting,
    string,
)

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


def _categories(value: Any, key: str) -> tuple[str, ...] | None:
    """None (all categories), one name, or a list of names (``base`` or ``multi_turn_base`` both work)."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise key_error(key, "null, a string or a list of strings", value)


def _guidelines(value: Any, key: str) -> dict[str, str | None] | None:
    """Per-tag guideline overrides for capability cues: text replaces ours, null removes the tag."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise key_error(key, "null or a mapping tag -> text|null", value)
    for tag, text in value.items():
        if not isinstance(tag, str) or not (text is None or isinstance(text, str)):
            raise ValueError(f"config key '{key}': entries must be tag -> text or null, got {tag!r}: {text!r}")
    return dict(value)


# ----------------------------------------------------------------------------------------------
# The blocks
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObservationLiteConfig(ConfigBlock):
    """Schema cues on the tool docs shown in the system prompt (train-only by default)."""

    enable: bool = setting(False, boolean)
    apply_to_validation: bool = setting(False, boolean)
    add_required_hint: bool = setting(True, boolean)
    add_type_hint: bool = setting(False, boolean)
    add_enum_hint: bool = setting(True, boolean)
    hide_optional: bool = setting(False, boolean)
    categories: tuple[str, ...] | None = setting(None, _categories)
    instruction: str = setting(OBSERVATION_NOTE, string)


@dataclass(frozen=True)
class ToolFeedbackConfig(ConfigBlock):
    """``tool_feedback_evolution``: recovery hints after parse errors and tool errors."""

    enable: bool = setting(False, boolean)
    apply_to_validation: bool = setting(False, boolean)
    categories: tuple[str, ...] | None = setting(None, _categories)
    max_tool_names: int = setting(12, integer(minimum=0))


@dataclass(frozen=True)
class CapabilityCuesConfig(ConfigBlock):
    """``diagnostic_evolution``: guideline lines chosen from the trainer's failure profile."""

    enable: bool = setting(False, boolean)
    apply_to_validation: bool = setting(False, boolean)
    categories: tuple[str, ...] | None = setting(None, _categories)
    min_tag_count: int = setting(8, integer(minimum=0))
    prevalence_threshold: float = setting(0.10, number(0.0, 1.0))
    reward_threshold: float = setting(0.6, number())
    max_lines: int = setting(3, integer(minimum=0))
    per_category: bool = setting(False, boolean)
    guidelines: dict[str, str | None] | None = setting(None, _guidelines)


@dataclass(frozen=True)
class RewardConfig(ConfigBlock):
    """The trajectory reward: the recipe's ``reward`` block, the trainer's ``seal.reward`` sent with each
    ``/evaluate``, and what the verifier scores with. ``binary``: BFCL pass/fail (vanilla RL and, with
    cap 0, SEAL).

    ``capped``: 1.0 on pass, else min(partial_credit_cap, partial_credit_weight * progress), clamped to [0, 1].
    ``t3rl``: 1.0 on pass, else (passed + w*passed_irr) / (scorable + w*irr), w = irrelevance_weight.

    :meth:`from_dict` (requests, recipes) holds values to their ranges; built directly (tests, the
    verifier's callers) only the mode and finite numbers are required, out-of-range values are clamped.
    """

    mode: str = setting("binary", choice(REWARD_MODES))
    partial_credit_cap: float = setting(0.7, number(0.0, 1.0))
    partial_credit_weight: float = setting(1.0, number(0.0))
    irrelevance_weight: float = setting(0.5, number(0.0))
    scorable_floor: bool = setting(False, boolean)

    def __post_init__(self) -> None:
        if self.mode not in REWARD_MODES:
            raise ValueError(f"unknown reward mode {self.mode!r}; expected one of {REWARD_MODES}")
        for name in ("partial_credit_cap", "partial_credit_weight", "irrelevance_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class EnvConfig(ConfigBlock):
    """The whole ``env_service.bfcl`` block."""

    strict_tool_parser: bool = setting(True, boolean)
    enforce_available_tools: bool = setting(True, boolean)
    tool_prompt_mode: str = setting("bfcl_qwen_fc", choice(TOOL_PROMPT_MODES))
    tool_result_mode: str = setting("bfcl_tool_response", choice(TOOL_RESULT_MODES))
    observation_lite: ObservationLiteConfig = setting(ObservationLiteConfig(), block(ObservationLiteConfig))
    tool_feedback_evolution: ToolFeedbackConfig = setting(ToolFeedbackConfig(), block(ToolFeedbackConfig))
    capability_cues: CapabilityCuesConfig = setting(CapabilityCuesConfig(), block(CapabilityCuesConfig))
    reward: RewardConfig = setting(RewardConfig(), block(RewardConfig))


@dataclass(frozen=True)
class ServiceLimits(ConfigBlock):
    """What one episode and one client may cost the service (``python -m env_service serve`` flags).

    Budgets are wall-clock seconds of backend work, enforced inside the worker processes (a call over its
    budget is interrupted; a worker that does not answer within its budget plus ``worker_grace_s`` is
    killed and replaced). Defaults sit far above anything the ground truth or a sane model needs: the
    slowest ground-truth call takes milliseconds, the largest ground-truth reply is 31 KB, a ground-truth
    turn has at most 34 calls and the largest backend state is 27 KB.
    """

    call_budget_s: float = setting(2.0, number(0.001))
    message_budget_s: float = setting(5.0, number(0.001))
    evaluate_budget_s: float = setting(10.0, number(0.001))
    worker_grace_s: float = setting(5.0, number(0.0))
    # What one episode's replay on a replacement worker may take beyond twice its own recorded cost (the worker time
    # its create and accepted messages took); each episode has its own, whatever the others on the worker cost.
    replay_budget_s: float = setting(30.0, number(0.0))
    # How long a request waits behind another episode's request running on its worker (a message may run its whole
    # budget) before its episode is moved to a calm worker, by a replay; 0: never moved (env_service.workers.pool).
    move_after_s: float = setting(0.25, number(0.0))
    call_memory_mib: int = setting(256, integer(minimum=1))  # resident memory one call may add
    worker_memory_mib: int = setting(4096, integer(minimum=0))  # address-space cap per worker; 0: none
    max_steps: int = setting(100, integer(minimum=1))
    # CPU seconds all of one episode's messages may use together (reading them and running their calls), however
    # cheap each is: beyond, the next message gets a limit text and the episode ends. A ground-truth episode uses well
    # under 0.1 s; without it one episode could use max_steps x message_budget_s (500 s) of a worker.
    episode_cpu_budget_s: float = setting(30.0, number(0.001))
    max_calls_per_message: int = setting(64, integer(minimum=1))
    max_reply_bytes: int = setting(128 * 1024, integer(minimum=256))
    max_errors_per_message: int = setting(8, integer(minimum=1))  # parse errors shown and kept per message
    # What one episode keeps between messages (records: accepted calls' arguments, kept results, errors,
    # its prompt), measured like the state (env_service.sizes.measured_bytes); beyond it the episode ends with a text.
    max_episode_bytes: int = setting(16 * 1024 * 1024, integer(minimum=64 * 1024))
    max_state_bytes: int = setting(8 * 1024 * 1024, integer(minimum=1024))
    # What all the live episodes of one client keep together (a client is its address, ``peer_key``, whatever run ids
    # it names: limits that protect other clients cannot be multiplied by minting run ids): their records and last
    # measured states in the workers, and their messages in the service (kept to rebuild them after a worker loss).
    # Beyond it the client's steps and creates are refused until it releases episodes; one client then stays well
    # inside a worker's worker_memory_mib (a ground-truth episode keeps 100 KB at most).
    max_owner_bytes: int = setting(1024 * 1024 * 1024, integer(minimum=1024 * 1024))
    max_episodes: int = setting(4096, integer(minimum=1))
    max_episodes_per_owner: int = setting(1024, integer(minimum=1))  # live episodes of one client (all its run ids)
    # Verdicts of released episodes kept for a retried evaluate (its first answer lost), each for 10 minutes: at most
    # evaluations_kept_per_client of one client, evaluations_kept of all together (beyond, the oldest verdict of the
    # client keeping the most goes), so a client finishing thousands of episodes evicts its own verdicts, not others'.
    evaluations_kept_per_client: int = setting(2048, integer(minimum=1))
    evaluations_kept: int = setting(4096, integer(minimum=1))
    # The same verdicts in bytes (kept as their JSON, measured): a ground-truth verdict is ~2 KB, so 2,048 of a client
    # keep ~4 MiB; an OOD memory prerequisite's carries its snapshot (up to 1 MiB), so a client keeps 64 of those.
    evaluation_bytes_kept_per_client: int = setting(64 * 1024 * 1024, integer(minimum=1024 * 1024))
    evaluation_bytes_kept: int = setting(256 * 1024 * 1024, integer(minimum=1024 * 1024))
    # Failure profiles of the runs of one client, and of all runs, in bytes (kept as their JSON): at most 1 MiB each
    # (manager.MAX_PROFILE_BYTES), so a client's 16 run ids fit, and the 64 runs kept at once.
    profile_bytes_kept_per_client: int = setting(16 * 1024 * 1024, integer(minimum=1024 * 1024))
    profile_bytes_kept: int = setting(64 * 1024 * 1024, integer(minimum=1024 * 1024))
    idle_timeout_s: float = setting(600.0, number(0.0))
    reclaim_interval_s: float = setting(15.0, number(0.01))


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
