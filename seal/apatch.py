"""A-Patch: diagnosis-guided scaling of GRPO advantages (SPEC A1, B §6.2).

Each trajectory carries one diagnosis tag per ground-truth user turn. Its advantage row is multiplied
by ``clip(mean weight over its tags, min_scale, max_scale)``. The scale is strictly positive, so the
sign of every advantage — and therefore the verifier's ranking inside a GRPO group — never changes;
rows whose GRPO advantage is zero stay zero. With the closed loop on, the weights are first moved by
the capability state (`CapabilityState.update_dynamic_tag_weights`, SPEC B §6.3).

Deliberate differences from the released code:
* Zero is a value. Upstream read ``ema_beta``, ``prevalence_alpha``, ``confidence_samples``,
  ``warmup_steps`` and budget ``strength`` as ``x or default``, so an explicit 0 silently became the
  default. Here 0 means 0 (e.g. ``ema_beta: 0`` freezes the weights at their static values).
* Config is validated: unknown keys, wrong types and out-of-range values raise ``ValueError``.
* ``tag_weights`` overrides may add new tags from any mapping (upstream only from a plain ``dict``,
  not from a Hydra ``DictConfig``).
* ``dynamic.enable`` defaults to true and takes effect only when a capability state is passed
  (upstream: defaults to "a state exists", which is the same in practice).
* Budget renormalisation happens only when ``budget.target_mean`` is set (upstream: ``normalize_mean``
  defaulting to true with target 1.0). Budget is off in every recipe.
* `apply_apatch` returns a new tensor instead of scaling the batch in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

import torch

from seal.capability_state import EXCLUDED_TAGS, CapabilityState

# Upstream's static utility weights (SEAL.yaml). Tags not listed weigh 1.0.
DEFAULT_TAG_WEIGHTS: dict[str, float] = {
    "spurious_tool_call": 2.0,
    "correct_abstention": 1.8,
    "empty_turn_model_response": 1.5,
    "state_mismatch": 1.0,
    "response_mismatch": 0.9,
    "instance_mismatch": 0.6,
    "pass": 1.0,
}

# OURS — the paper's Table-5 labels have no released weights. Chosen to mirror the progress-tag
# weights wherever a label has a progress-tag counterpart, so switching vocabulary changes the
# evidence, not the emphasis:
#   state_mismatch / response_mismatch / pass: same meaning as the progress tags → same weights;
#   invalid_tool_call 2.0: unparseable call or a tool that does not exist — the sharpest interface
#     error, like spurious_tool_call (calling at all when nothing may be called);
#   missing_tool_call 1.5: skipped a needed call / answered too early, like empty_turn_model_response;
#   argument_mismatch 1.5: right tool, wrong field/type/enum — actionable and specific;
#   recovery_failure 1.2: got executable error feedback and did not recover — actionable but often
#     a consequence of an earlier error already weighted by another label.
DEFAULT_LABEL_WEIGHTS: dict[str, float] = {
    "invalid_tool_call": 2.0,
    "argument_mismatch": 1.5,
    "state_mismatch": 1.0,
    "recovery_failure": 1.2,
    "missing_tool_call": 1.5,
    "response_mismatch": 0.9,
    "pass": 1.0,
}

APPLY_TO = ("all", "positive_advantage", "negative_advantage")
VOCABULARIES = ("progress_tags", "paper_labels")
# Which per-trajectory field carries each vocabulary (diagnostics / trainer use this).
VOCABULARY_FIELD = {"progress_tags": "tags", "paper_labels": "labels"}


# ---------------------------------------------------------------------------------------- config
@dataclass
class DynamicConfig:
    enable: bool = True
    ema_beta: float = 0.25
    prevalence_alpha: float = 1.0
    confidence_samples: int = 32

    def __post_init__(self) -> None:
        p = "apatch.dynamic"
        _require_bool(f"{p}.enable", self.enable)
        self.ema_beta = _require_number(f"{p}.ema_beta", self.ema_beta, lo=0.0, hi=1.0)
        self.prevalence_alpha = _require_number(f"{p}.prevalence_alpha", self.prevalence_alpha, lo=0.0)
        self.confidence_samples = _require_int(f"{p}.confidence_samples", self.confidence_samples, lo=0)


@dataclass
class BudgetConfig:
    enable: bool = False
    strength: float = 1.0
    min_scale: float | None = None  # None → the A-Patch min_scale
    max_scale: float | None = None  # None → the A-Patch max_scale
    target_mean: float | None = None  # None → no mean renormalisation

    def __post_init__(self) -> None:
        p = "apatch.budget"
        _require_bool(f"{p}.enable", self.enable)
        self.strength = _require_number(f"{p}.strength", self.strength, lo=0.0)
        if self.min_scale is not None:
            self.min_scale = _require_number(f"{p}.min_scale", self.min_scale, lo=0.0, lo_open=True)
        if self.max_scale is not None:
            self.max_scale = _require_number(f"{p}.max_scale", self.max_scale, lo=0.0, lo_open=True)
        if self.target_mean is not None:
            self.target_mean = _require_number(f"{p}.target_mean", self.target_mean, lo=0.0, lo_open=True)


@dataclass
class APatchConfig:
    enable: bool = False
    min_scale: float = 0.5
    max_scale: float = 2.0
    apply_to: str = "all"
    metric_prefix: str = "seal/apatch"
    warmup_steps: int = 0
    vocabulary: str = "progress_tags"
    # Overrides merged on top of DEFAULT_TAG_WEIGHTS / DEFAULT_LABEL_WEIGHTS (after construction the
    # field holds the merged map).
    tag_weights: dict[str, float] = field(default_factory=dict)
    label_weights: dict[str, float] = field(default_factory=dict)
    excluded_tags: tuple[str, ...] = EXCLUDED_TAGS
    dynamic: DynamicConfig = field(default_factory=DynamicConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)

    def __post_init__(self) -> None:
        _require_bool("apatch.enable", self.enable)
        self.min_scale = _require_number("apatch.min_scale", self.min_scale, lo=0.0, lo_open=True)
        self.max_scale = _require_number("apatch.max_scale", self.max_scale, lo=0.0, lo_open=True)
        if self.min_scale > self.max_scale:
            raise ValueError(f"apatch.min_scale ({self.min_scale}) must be <= apatch.max_scale ({self.max_scale})")
        _require_choice("apatch.apply_to", self.apply_to, APPLY_TO)
        _require_choice("apatch.vocabulary", self.vocabulary, VOCABULARIES)
        if not isinstance(self.metric_prefix, str) or not self.metric_prefix:
            raise ValueError(f"apatch.metric_prefix must be a non-empty string, got {self.metric_prefix!r}")
        self.warmup_steps = _require_int("apatch.warmup_steps", self.warmup_steps, lo=0)
        self.tag_weights = _merge_weights("apatch.tag_weights", DEFAULT_TAG_WEIGHTS, self.tag_weights)
        self.label_weights = _merge_weights("apatch.label_weights", DEFAULT_LABEL_WEIGHTS, self.label_weights)
        self.excluded_tags = _require_str_tuple("apatch.excluded_tags", self.excluded_tags)
        if isinstance(self.dynamic, Mapping):
            self.dynamic = _build(DynamicConfig, self.dynamic, "apatch.dynamic")
        if isinstance(self.budget, Mapping):
            self.budget = _build(BudgetConfig, self.budget, "apatch.budget")
        if not isinstance(self.dynamic, DynamicConfig) or not isinstance(self.budget, BudgetConfig):
            raise ValueError("apatch.dynamic / apatch.budget must be mappings")
        lo = self.budget_min_scale
        hi = self.budget_max_scale
        if lo > hi:
            raise ValueError(f"apatch.budget.min_scale ({lo}) must be <= apatch.budget.max_scale ({hi})")

    @property
    def budget_min_scale(self) -> float:
        return self.min_scale if self.budget.min_scale is None else self.budget.min_scale

    @property
    def budget_max_scale(self) -> float:
        return self.max_scale if self.budget.max_scale is None else self.budget.max_scale

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "APatchConfig":
        """Build from the recipe's ``seal.apatch`` block (upstream ``tocf.advantage.apatch``; plain or OmegaConf).
        Unknown keys raise ``ValueError``; missing keys take the defaults; zeros stay zeros."""
        return _build(cls, _plain(raw), "apatch")


def _plain(raw: Any, where: str = "apatch") -> dict[str, Any]:
    if raw is None:
        return {}
    try:  # OmegaConf containers → plain python, so the key checks below see real keys
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(raw, (DictConfig, ListConfig)):
            raw = OmegaConf.to_container(raw, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with verl
        pass
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
    return dict(raw)


def _build(cls, raw: Mapping[str, Any], where: str):
    raw = _plain(raw, where)
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}; allowed: {sorted(allowed)}")
    kwargs = dict(raw)
    # An empty YAML block (`dynamic:` / `tag_weights:` with nothing under it) reads as None: defaults.
    for key in ("dynamic", "budget", "tag_weights", "label_weights"):
        if key in kwargs and kwargs[key] is None:
            del kwargs[key]
    return cls(**kwargs)


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _require_number(name, value, lo=None, hi=None, lo_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _require_int(name, value, lo=None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _require_choice(name, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _require_str_tuple(name, value) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of tag names, got {value!r}")
    return tuple(value)


def _merge_weights(name: str, defaults: Mapping[str, float], overrides: Any) -> dict[str, float]:
    overrides = _plain(overrides, name)
    merged = dict(defaults)
    for tag, weight in overrides.items():
        merged[str(tag)] = _require_number(f"{name}.{tag}", weight, lo=0.0)
    return merged


def resolve_weights(cfg: APatchConfig) -> dict[str, float]:
    """Static utility weights of the configured vocabulary (defaults overridden per key)."""
    return dict(cfg.tag_weights if cfg.vocabulary == "progress_tags" else cfg.label_weights)


def vocabulary_field(vocabulary: str) -> str:
    """Trajectory field (``tags`` or ``labels``) that feeds A-Patch and the capability state."""
    _require_choice("vocabulary", vocabulary, VOCABULARIES)
    return VOCABULARY_FIELD[vocabulary]


# ---------------------------------------------------------------------------------------- scales
def row_tags(row: Sequence[str] | None) -> list[str]:
    """Normalise one row's tag list; [] means "no tags" (scale 1, counted as missing)."""
    if row is None:
        return []
    if isinstance(row, str):
        raise TypeError(f"each row's tags must be a sequence of strings, got the string {row!r}")
    return [str(t) for t in row if t]


def row_scale(tags: Sequence[str], weights: Mapping[str, float], min_scale: float, max_scale: float,
              excluded: Sequence[str] = EXCLUDED_TAGS) -> float:
    """clip(mean weight over the effective tags, min, max); 1.0 when no tag is effective.
    checker_error/gt_error are scorer problems, not model behaviour, so they do not count."""
    effective = [t for t in tags if t not in excluded]
    if not effective:
        return 1.0
    raw = sum(float(weights.get(t, 1.0)) for t in effective) / len(effective)
    return min(max_scale, max(min_scale, raw))


def per_row_scales(tags: Sequence[Sequence[str] | None], weights: Mapping[str, float], min_scale: float,
                   max_scale: float, excluded: Sequence[str] = EXCLUDED_TAGS) -> list[float]:
    """Pre-budget scale of every row (rows without tags → 1.0)."""
    return [row_scale(row_tags(r), weights, min_scale, max_scale, excluded) for r in tags]


def apply_budget(scales: list[float], tagged: Sequence[int], budget: BudgetConfig, lo: float,
                 hi: float) -> tuple[list[float], float, float]:
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
    _require_choice("apply_to", apply_to, APPLY_TO)
    shape = (advantages.shape[0],) + (1,) * (advantages.dim() - 1)
    s = torch.as_tensor(list(scales), dtype=advantages.dtype, device=advantages.device).view(shape)
    if apply_to == "all":
        return advantages * s
    selected = advantages > 0 if apply_to == "positive_advantage" else advantages < 0
    return torch.where(selected, advantages * s, advantages)


# ---------------------------------------------------------------------------------------- entry
def apply_apatch(
    advantages: torch.Tensor,
    tags: Sequence[Sequence[str] | None],
    cfg: APatchConfig | Mapping[str, Any],
    global_step: int,
    state: CapabilityState | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scale GRPO advantages [B, R] by per-trajectory tag weights. Returns (new advantages, metrics).

    Order (SPEC B §1.6 step 13): warmup check → dynamic weight update (closed loop on and a state
    given) → per-row scales → optional budget → scaling per ``apply_to``.
    ``tags[i]`` is row i's tag list in the configured vocabulary; None/[] = no tags.
    """
    if not isinstance(cfg, APatchConfig):
        cfg = APatchConfig.from_dict(cfg)
    p = cfg.metric_prefix
    if not cfg.enable:
        return advantages, {f"{p}/enabled": 0.0}
    if advantages.dim() < 1 or advantages.shape[0] != len(tags):
        raise ValueError(f"advantages have {advantages.shape[0] if advantages.dim() else 0} rows but {len(tags)} tag lists")
    if global_step < cfg.warmup_steps:
        # Upstream also skips the weight update during warmup: the closed loop starts with scaling.
        return advantages, {f"{p}/enabled": 1.0, f"{p}/warmup_skipped": 1.0, f"{p}/scaled_count": 0.0}

    weights = resolve_weights(cfg)
    dynamic_on = cfg.dynamic.enable and state is not None
    if dynamic_on:
        weights = state.update_dynamic_tag_weights(
            weights,
            min_scale=cfg.min_scale,
            max_scale=cfg.max_scale,
            ema_beta=cfg.dynamic.ema_beta,
            alpha=cfg.dynamic.prevalence_alpha,
            confidence_samples=cfg.dynamic.confidence_samples,
            excluded=cfg.excluded_tags,
        )

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
    metrics.update({f"{p}/tag_weight/{t}": float(w) for t, w in sorted(weights.items())})
    return out, metrics


def _tag_fractions(rows: Sequence[Sequence[str]], prefix: str) -> dict[str, float]:
    """Share of each tag among all tag occurrences of the batch (excluded tags included)."""
    counts: dict[str, int] = {}
    for row in rows:
        for t in row:
            counts[t] = counts.get(t, 0) + 1
    total = sum(counts.values())
    return {f"{prefix}/tag_frac/{t}": c / total for t, c in sorted(counts.items())}
