"""A-Patch: diagnosis-guided scaling of GRPO advantages, and the closed loop that moves its weights.

Each trajectory carries one diagnosis tag per ground-truth user turn. Its advantage row is multiplied by

    scale = clip(mean over its tags t of w_t, min_scale, max_scale)

(scorer tags such as ``checker_error`` do not count; a row with no effective tag keeps scale 1). The scale is
strictly positive, so the sign of every advantage — and the verifier's ranking inside a GRPO group — never
changes, and rows whose GRPO advantage is zero stay zero. With the closed loop on, the weights w are first moved
toward what the capability state shows (`dynamic_weights`):

    target_t = clip(base_t · (1 + alpha · (n_t / N) · (1 − mean reward_t) · min(1, n_t / C)), min_scale, max_scale)
    w_t     ← (1 − beta) · w_t + beta · target_t

docs/method.md derives both; docs/upstream-differences.md lists where this module departs from the released code
(zeros in the config are values, the config is validated, the budget renormalises only on request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from env_service.config_blocks import (
    ConfigBlock,
    block,
    boolean,
    choice,
    integer,
    key_error,
    nonempty_string,
    number,
    optional,
    setting,
    strings,
)
from env_service.vocabulary import (
    LABEL_ARGUMENT_MISMATCH,
    LABEL_INVALID_TOOL_CALL,
    LABEL_MISSING_TOOL_CALL,
    LABEL_PASS,
    LABEL_RECOVERY_FAILURE,
    LABEL_RESPONSE_MISMATCH,
    LABEL_STATE_MISMATCH,
    SCORER_TAGS,
    TAG_CORRECT_ABSTENTION,
    TAG_EMPTY_TURN,
    TAG_INSTANCE_MISMATCH,
    TAG_PASS,
    TAG_RESPONSE_MISMATCH,
    TAG_SPURIOUS_TOOL_CALL,
    TAG_STATE_MISMATCH,
)
from seal.capability_state import CapabilityState, CapabilityStats

if TYPE_CHECKING:  # torch is imported where tensors are scaled: the launcher checks APatchConfig before it loads torch
    import torch

# The released recipe's static utility weights. Tags not listed weigh 1.0.
DEFAULT_TAG_WEIGHTS: dict[str, float] = {
    TAG_SPURIOUS_TOOL_CALL: 2.0,
    TAG_CORRECT_ABSTENTION: 1.8,
    TAG_EMPTY_TURN: 1.5,
    TAG_STATE_MISMATCH: 1.0,
    TAG_RESPONSE_MISMATCH: 0.9,
    TAG_INSTANCE_MISMATCH: 0.6,
    TAG_PASS: 1.0,
}

# Ours: the paper's labels have no released weights. They mirror the progress-tag weights wherever a label has a
# progress-tag counterpart, so switching vocabulary changes the evidence, not the emphasis (docs/method.md).
DEFAULT_LABEL_WEIGHTS: dict[str, float] = {
    LABEL_INVALID_TOOL_CALL: 2.0,  # the sharpest interface error, like spurious_tool_call
    LABEL_ARGUMENT_MISMATCH: 1.5,  # right tool, wrong field / type / value: specific and actionable
    LABEL_STATE_MISMATCH: 1.0,
    LABEL_RECOVERY_FAILURE: 1.2,  # actionable, but often the consequence of an error another label weighs
    LABEL_MISSING_TOOL_CALL: 1.5,  # like empty_turn_model_response
    LABEL_RESPONSE_MISMATCH: 0.9,
    LABEL_PASS: 1.0,
}

APPLY_TO = ("all", "positive_advantage", "negative_advantage")
VOCABULARIES = ("progress_tags", "paper_labels")
# Which per-trajectory field carries each vocabulary (diagnostics / trainer use this).
VOCABULARY_FIELD = {"progress_tags": "tags", "paper_labels": "labels"}


# ---------------------------------------------------------------------------------------- config
# The blocks are read like the environment's (``env_service/config_blocks.py``): an unknown key or a bad value is a
# ``ValueError`` naming its path (``seal.apatch.dynamic.ema_beta``); an empty YAML block (``dynamic:``) reads as the defaults.
def _weights(defaults: Mapping[str, float]):
    """A tag -> weight map merged on top of ``defaults`` (after reading, the field holds the merged map)."""

    def check(value: Any, key: str) -> dict[str, float]:
        if value is None:
            return dict(defaults)
        if not isinstance(value, Mapping):
            raise key_error(key, "a mapping tag -> weight", value)
        merged = dict(defaults)
        for tag, weight in value.items():
            merged[str(tag)] = number(lo=0.0)(weight, f"{key}.{tag}")
        return merged

    return check


_SCALE = number(above=0.0)


@dataclass(frozen=True)
class DynamicConfig(ConfigBlock):
    enable: bool = setting(True, boolean)
    ema_beta: float = setting(0.25, number(0.0, 1.0))
    prevalence_alpha: float = setting(1.0, number(lo=0.0))
    confidence_samples: int = setting(32, integer(minimum=0))


@dataclass(frozen=True)
class BudgetConfig(ConfigBlock):
    enable: bool = setting(False, boolean)
    strength: float = setting(1.0, number(lo=0.0))
    min_scale: float | None = setting(None, optional(_SCALE))  # None → the A-Patch min_scale
    max_scale: float | None = setting(None, optional(_SCALE))  # None → the A-Patch max_scale
    target_mean: float | None = setting(None, optional(_SCALE))  # None → no mean renormalisation


@dataclass(frozen=True)
class APatchConfig(ConfigBlock):
    enable: bool = setting(False, boolean)
    min_scale: float = setting(0.5, _SCALE)
    max_scale: float = setting(2.0, _SCALE)
    apply_to: str = setting("all", choice(APPLY_TO))
    metric_prefix: str = setting("seal/apatch", nonempty_string)
    warmup_steps: int = setting(0, integer(minimum=0))
    vocabulary: str = setting("progress_tags", choice(VOCABULARIES))
    # Overrides merged on top of DEFAULT_TAG_WEIGHTS / DEFAULT_LABEL_WEIGHTS.
    tag_weights: dict[str, float] = setting(dict(DEFAULT_TAG_WEIGHTS), _weights(DEFAULT_TAG_WEIGHTS))
    label_weights: dict[str, float] = setting(dict(DEFAULT_LABEL_WEIGHTS), _weights(DEFAULT_LABEL_WEIGHTS))
    excluded_tags: tuple[str, ...] = setting(SCORER_TAGS, strings)
    dynamic: DynamicConfig = setting(DynamicConfig(), block(DynamicConfig))
    budget: BudgetConfig = setting(BudgetConfig(), block(BudgetConfig))

    def check_fields(self, path: str) -> None:
        if self.min_scale > self.max_scale:
            raise ValueError(f"{path}.min_scale ({self.min_scale}) must be <= {path}.max_scale ({self.max_scale})")
        if self.budget_min_scale > self.budget_max_scale:
            raise ValueError(
                f"{path}.budget.min_scale ({self.budget_min_scale}) must be <= {path}.budget.max_scale "
                f"({self.budget_max_scale})"
            )

    @property
    def budget_min_scale(self) -> float:
        return self.min_scale if self.budget.min_scale is None else self.budget.min_scale

    @property
    def budget_max_scale(self) -> float:
        return self.max_scale if self.budget.max_scale is None else self.budget.max_scale

    @classmethod
    def from_dict(cls, data: Any, *, path: str = "seal.apatch") -> APatchConfig:
        """Build from the recipe's ``seal.apatch`` block (upstream ``tocf.advantage.apatch``; plain or OmegaConf).
        Unknown keys raise ``ValueError``; missing keys take the defaults; zeros stay zeros."""
        from omegaconf import DictConfig, OmegaConf

        if isinstance(data, DictConfig):  # OmegaConf → plain python, so the key checks see real keys
            data = OmegaConf.to_container(data, resolve=True)
        return super().from_dict(data, path=path)


def resolve_weights(cfg: APatchConfig) -> dict[str, float]:
    """Static utility weights of the configured vocabulary (defaults overridden per key)."""
    return dict(cfg.tag_weights if cfg.vocabulary == "progress_tags" else cfg.label_weights)


def vocabulary_field(vocabulary: str) -> str:
    """Trajectory field (``tags`` or ``labels``) that feeds A-Patch and the capability state."""
    choice(VOCABULARIES)(vocabulary, "vocabulary")
    return VOCABULARY_FIELD[vocabulary]


# ---------------------------------------------------------------------------------------- scales
def row_tags(row: Sequence[str] | None) -> list[str]:
    """Normalise one row's tag list; [] means "no tags" (scale 1, counted as missing)."""
    if row is None:
        return []
    if isinstance(row, str):
        raise TypeError(f"each row's tags must be a sequence of strings, got the string {row!r}")
    return [str(t) for t in row if t]


def row_scale(
    tags: Sequence[str],
    weights: Mapping[str, float],
    min_scale: float,
    max_scale: float,
    excluded: Sequence[str] = SCORER_TAGS,
) -> float:
    """clip(mean weight over the effective tags, min, max); 1.0 when no tag is effective.
    The excluded tags (by default the scorer's own problems) say nothing about the model, so they do not count."""
    effective = [t for t in tags if t not in excluded]
    if not effective:
        return 1.0
    raw = sum(float(weights.get(t, 1.0)) for t in effective) / len(effective)
    return min(max_scale, max(min_scale, raw))


def per_row_scales(
    tags: Sequence[Sequence[str] | None],
    weights: Mapping[str, float],
    min_scale: float,
    max_scale: float,
    excluded: Sequence[str] = SCORER_TAGS,
) -> list[float]:
    """Pre-budget scale of every row (rows without tags → 1.0)."""
    return [row_scale(row_tags(r), weights, min_scale, max_scale, excluded) for r in tags]


def apply_budget(
    scales: list[float], tagged: Sequence[int], budget: BudgetConfig, lo: float, hi: float
) -> tuple[list[float], float, float]:
    """Soften the tagged rows' scales toward 1, clamp, optionally renormalise their mean, clamp.
    Returns (new scales, mean before, mean after) over the tagged rows (1.0 when there are none)."""
    if not tagged:
        return list(scales), 1.0, 1.0
    selected = [scales[i] for i in tagged]
    mean_before = sum(selected) / len(selected)
    selected = [min(hi, max(lo, 1.0 + budget.strength * (s - 1.0))) for s in selected]
    if budget.target_mean is not None:
        mean_now = max(sum(selected) / len(selected), 1e-6)
        selected = [min(hi, max(lo, s * budget.target_mean / mean_now)) for s in selected]
    out = list(scales)
    for i, s in zip(tagged, selected):
        out[i] = s
    return out, mean_before, sum(selected) / len(selected)


def scale_advantages(advantages: torch.Tensor, scales: Sequence[float], apply_to: str) -> torch.Tensor:
    """Multiply row i by scales[i] — all entries, or only positive / only negative ones."""
    import torch

    choice(APPLY_TO)(apply_to, "apply_to")
    shape = (advantages.shape[0],) + (1,) * (advantages.dim() - 1)
    s = torch.as_tensor(list(scales), dtype=advantages.dtype, device=advantages.device).view(shape)
    if apply_to == "all":
        return advantages * s
    selected = advantages > 0 if apply_to == "positive_advantage" else advantages < 0
    return torch.where(selected, advantages * s, advantages)


# ---------------------------------------------------------------------------------------- closed loop
def dynamic_weights(
    base: Mapping[str, float], previous: Mapping[str, float], evidence: Mapping[str, CapabilityStats], cfg: APatchConfig
) -> dict[str, float] | None:
    """One closed-loop step: the weights A-Patch uses now, moved from ``previous`` toward what ``evidence`` shows.

    ``base``: the static weights; ``previous``: the weights of the last step ({} at first); ``evidence``: the
    capability state's per-tag counts and mean rewards. N = occurrences of non-excluded tags in ``evidence``;
    N = 0 → None (nothing to learn from: the caller keeps the static weights). Otherwise, for every tag in
    base ∪ evidence ∪ previous: an excluded tag's target is 1, ``pass`` keeps its base weight, any other tag t
    seen n_t times with mean reward r_t gets

        target_t = base_t · (1 + alpha · (n_t / N) · (1 − r_t) · min(1, n_t / C))

    clamped to [min_scale, max_scale], and the new weight is (1 − beta) · previous_t + beta · target_t (previous_t
    defaults to base_t). C = ``confidence_samples``; below 1 it acts as 1 (full confidence from the first
    sample), as in the released code: that avoids a division by zero rather than redefining 0.
    """
    excluded = frozenset(cfg.excluded_tags)
    n_total = sum(s.count for t, s in evidence.items() if t not in excluded)
    if n_total <= 0:
        return None
    dyn = cfg.dynamic
    confidence_div = max(1, int(dyn.confidence_samples))
    updated: dict[str, float] = {}
    for tag in sorted(set(base) | set(evidence) | set(previous)):
        base_t = float(base.get(tag, 1.0))
        if tag in excluded:
            target = 1.0
        elif tag == TAG_PASS:
            target = base_t
        else:
            stats = evidence.get(tag, CapabilityStats())
            prevalence = stats.count / n_total
            stagnation = 1.0 - stats.reward_mean
            confidence = min(1.0, stats.count / confidence_div)
            target = base_t * (1.0 + dyn.prevalence_alpha * prevalence * stagnation * confidence)
        target = min(cfg.max_scale, max(cfg.min_scale, target))
        updated[tag] = (1.0 - dyn.ema_beta) * float(previous.get(tag, base_t)) + dyn.ema_beta * target
    return updated


# ---------------------------------------------------------------------------------------- entry
def apply_apatch(
    advantages: torch.Tensor,
    tags: Sequence[Sequence[str] | None],
    cfg: APatchConfig | Mapping[str, Any],
    global_step: int,
    state: CapabilityState | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scale GRPO advantages [B, R] by per-trajectory tag weights. Returns (new advantages, metrics).

    Order (the released code's): warmup check → closed-loop weight update (on, and a state given; the state keeps
    the new weights) → per-row scales → optional budget → scaling per ``apply_to``.
    ``tags[i]`` is row i's tag list in the configured vocabulary; None/[] = no tags.
    """
    if not isinstance(cfg, APatchConfig):
        cfg = APatchConfig.from_dict(cfg)
    p = cfg.metric_prefix
    if not cfg.enable:
        return advantages, {f"{p}/enabled": 0.0}
    if advantages.dim() < 1 or advantages.shape[0] != len(tags):
        raise ValueError(
            f"advantages have {advantages.shape[0] if advantages.dim() else 0} rows but {len(tags)} tag lists"
        )
    if global_step < cfg.warmup_steps:
        # Upstream also skips the weight update during warmup: the closed loop starts with scaling.
        return advantages, {f"{p}/enabled": 1.0, f"{p}/warmup_skipped": 1.0, f"{p}/scaled_count": 0.0}

    weights = resolve_weights(cfg)
    dynamic_on = cfg.dynamic.enable and state is not None
    if dynamic_on:
        moved = dynamic_weights(weights, state.dynamic_tag_weights, state.tag_evidence(), cfg)
        if moved is not None:  # without evidence this step uses the static weights and the state keeps its own
            state.dynamic_tag_weights = moved
            weights = dict(moved)

    rows = [row_tags(r) for r in tags]
    tagged = [i for i, r in enumerate(rows) if r]
    scales = [row_scale(r, weights, cfg.min_scale, cfg.max_scale, cfg.excluded_tags) if r else 1.0 for r in rows]
    mean_scale = sum(scales[i] for i in tagged) / len(tagged) if tagged else 1.0
    budget_before = budget_after = 1.0
    if cfg.budget.enable:
        scales, budget_before, budget_after = apply_budget(
            scales, tagged, cfg.budget, cfg.budget_min_scale, cfg.budget_max_scale
        )
    out = scale_advantages(advantages, scales, cfg.apply_to)

    metrics = {
        f"{p}/enabled": 1.0,
        f"{p}/warmup_skipped": 0.0,
        f"{p}/scaled_count": float(len(tagged)),
        f"{p}/missing_tag_count": float(len(rows) - len(tagged)),
        f"{p}/mean_scale": float(mean_scale),
        f"{p}/budget_enabled": 1.0 if cfg.budget.enable else 0.0,
        f"{p}/budget_mean_before": float(budget_before),
        f"{p}/budget_mean_after": float(budget_after),
        f"{p}/dynamic_enabled": 1.0 if dynamic_on else 0.0,
    }
    metrics.update(_tag_fractions(rows, p))
    metrics.update(_scale_quantiles([scales[i] for i in tagged], p))
    metrics.update({f"{p}/tag_weight/{t}": float(w) for t, w in sorted(weights.items())})
    return out, metrics


SCALE_QUANTILES = {"min": 0.0, "p10": 0.10, "p25": 0.25, "p50": 0.50, "p75": 0.75, "p90": 0.90, "max": 1.0}


def _scale_quantiles(scales: Sequence[float], prefix: str) -> dict[str, float]:
    """The distribution of the applied scales over the tagged trajectories (``<prefix>/scale/<quantile>``)."""
    if not scales:
        return {}
    import torch

    values = torch.quantile(
        torch.tensor(scales, dtype=torch.float64), torch.tensor(list(SCALE_QUANTILES.values()), dtype=torch.float64)
    )
    return {f"{prefix}/scale/{name}": float(v) for name, v in zip(SCALE_QUANTILES, values.tolist())}


def _tag_fractions(rows: Sequence[Sequence[str]], prefix: str) -> dict[str, float]:
    """Share of each tag among all tag occurrences of the batch (excluded tags included)."""
    counts: dict[str, int] = {}
    for row in rows:
        for t in row:
            counts[t] = counts.get(t, 0) + 1
    total = sum(counts.values())
    return {f"{prefix}/tag_frac/{t}": c / total for t, c in sorted(counts.items())}
