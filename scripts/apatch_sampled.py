"""A-Patch against its neutral, swapped and off arms with the policy sampling its own episodes (Stage C of
docs/learning-check.md): Stage A's exact update, applied to batches the policy draws from itself every step.

Stage A weighs a fixed batch of the three candidates; the live check (Stage B) samples, and about half of what it
samples at temperature 1 is none of them: hybrids of their texts, which the environment tags
``empty_turn_model_response`` + ``pass`` and A-Patch weighs 1.25 and up. This check keeps Stage B's sampling and
Stage A's exactness, in-process:

- **a step**: the policy samples one mini-batch of the released shape (``ppo_mini_batch_size`` groups of
  ``rollout.n``) of first messages at temperature 1 from the shared prompt; each distinct message is played through
  the environment's episode code (``seal.cpu.warm_start.episode_tokens``: then the ground truth's other messages, the
  replies each call really gets, the verdict and tags); then Stage A's update (``apatch_exact.train_step``: verl's
  GRPO, ``SealTrainer._seal_step``, verl's actor loss with its KL loss against the warm start, the released AdamW
  after the engine's clipping);
- **pairing**: every arm of a seed draws its step-``t`` batch with the same uniform numbers (inverse-CDF sampling of
  each token), so arms whose policies are close draw the same episodes (common random numbers);
- **a shared trunk** per seed: ``TRUNK_UPDATES`` steps with A-Patch off from the warm start, saved with AdamW's
  state, so that the arms start where the recipe trains (a warmed optimizer); each arm then takes ``ARM_UPDATES``
  steps from it. The **fresh** condition runs the same arms from the warm start and a fresh AdamW;
- **the metric**: M = log pi(heavy) - log pi(light), teacher-forced (``apatch_exact.heavy_minus_light``), after each
  step; a seed's contrast is the difference of two arms' M after the last step.

The arms (``apatch_exact.arm_overrides``): ``on`` (the recipe), ``neutral`` (A-Patch on, the decoys' two tags
weighted 1: every other episode weighed as by ``on``), ``swapped`` (the decoys' weights exchanged), ``off``
(``seal.apatch.enable: false``), ``ones`` (every weight and both bounds 1: the negative control, which must equal
``off`` to the last bit) and ``on_mean1`` (``on`` with each batch's scales divided by their mean: the weights'
relative effect without their mean's).

``scripts/learning_check.py --apatch-sampled`` runs the study and its registered rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from pathlib import Path

import apatch_exact as ax
import torch

from seal.report.decoy_choice import FirstChoice
from seal.report.paired_test import paired_t, seeds_for_power

#: The live learning rate: Stage A's and Stage B's analogue of the released 1e-6 for the tiny model's width.
LIVE_LR = 2.8e-5
TRUNK_UPDATES = 10
ARM_UPDATES = 6
ARMS = ("on", "neutral", "swapped", "off", "ones", "on_mean1")
#: The fresh condition's arms: what explains on - off (the decoys' weights, the mean scale) without a trunk.
FRESH_ARMS = ("on", "neutral", "off", "on_mean1")
CONDITIONS = {"warmed": ARMS, "fresh": FRESH_ARMS}
PILOT_SEEDS = (3001, 3002, 3003, 3004, 3005)
#: The registered run's seeds: as many as the pilot's power computation asked for (docs/learning-check.md).
REGISTERED_SEEDS = tuple(range(4001, 4013))


@dataclasses.dataclass(frozen=True)
class Contrast:
    a: str
    b: str
    predicted: int  # -1: a below b (one-sided test), 0: reported two-sided

    @property
    def name(self) -> str:
        return f"{self.a}-{self.b}"


#: The registered contrasts, each M_a - M_b after the arms' last step in the warmed condition.
PRIMARY = (Contrast("on", "neutral", -1), Contrast("on", "swapped", -1))
REPORTED = (
    Contrast("neutral", "off", 0),
    Contrast("on", "off", 0),
    Contrast("on_mean1", "off", 0),
    Contrast("on", "on_mean1", 0),
)
#: Each primary test's one-sided level (0.05 over the two, Bonferroni) and the share of seeds that must lie in the
#: predicted direction besides.
ALPHA = 0.025
MIN_SHARE = 0.75


def count_needed(seeds: int) -> int:
    """The fewest of ``seeds`` that must lie in the predicted direction: MIN_SHARE of them, rounded up."""
    return -(-int(MIN_SHARE * 100) * seeds // 100)


# ---- sampling ----------------------------------------------------------------------------------------------------


def step_uniforms(seed: int, step: int, rows: int, tokens: int) -> torch.Tensor:
    """The uniform numbers of step ``step`` of seed ``seed``: the same for every arm (common random numbers)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{step}".encode()).digest()[:8], "little")
    return torch.rand(rows, tokens, generator=torch.Generator().manual_seed(key), dtype=torch.float64)


def sample_messages(model, prompt: list[int], uniforms: torch.Tensor, end_id: int) -> list[tuple[int, ...]]:
    """One first message per row of ``uniforms`` (rows x the most tokens a message may have), sampled from ``model``
    at temperature 1 by inverse CDF: token ``j`` of a row is where ``uniforms[row, j]`` falls in the cumulative
    distribution, so two close policies given the same uniforms sample the same tokens. A message ends at ``end_id``
    (included); one that reaches the limit is ended there (its end token appended, as a length-capped turn ends).

    Rows that have sampled the same tokens so far share one forward pass (their next-token distribution is the
    same): the model runs on the distinct open prefixes only, their keys and values selected from the cache."""
    rows, limit = uniforms.shape
    device = next(model.parameters()).device
    messages: list[list[int]] = [[] for _ in range(rows)]
    prefix_of: list[int | None] = [0] * rows  # the row's open prefix (its index in ``logits``), None once ended
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[:, -1]
        for j in range(limit):
            open_rows = [r for r in range(rows) if prefix_of[r] is not None]
            parents = [prefix_of[r] for r in open_rows]
            # the CDF on the CPU: torch has no deterministic CUDA cumsum of floats (deterministic mode refuses it)
            cdf = torch.softmax(logits.double(), dim=-1)[parents].cpu().cumsum(-1)
            u = uniforms[open_rows, j][:, None] * cdf[:, -1:]
            chosen = torch.searchsorted(cdf, u).clamp(max=cdf.shape[-1] - 1)[:, 0].tolist()
            children: dict[tuple[int, int], int] = {}  # (parent prefix, token) -> the new prefix's index
            for r, parent, token in zip(open_rows, parents, chosen):
                messages[r].append(token)
                prefix_of[r] = None if token == end_id else children.setdefault((parent, token), len(children))
            if not children:
                break
            cache.batch_select_indices(torch.tensor([p for p, _ in children], device=device))
            tokens = torch.tensor([[t] for _, t in children], device=device)
            logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits[:, -1]
    return [tuple(m if m[-1] == end_id else [*m, end_id]) for m in messages]


class EpisodePool:
    """The episodes of the first messages sampled so far, each played once through the environment's episode code,
    and their reference log-probabilities (the KL loss's warm start), computed once. The three candidates keep their
    names (``right``, ``heavy``, ``light``); any other message is ``other<k>``."""

    def __init__(self, candidates: dict[str, ax.Candidate], tokenizer, model_type: str, recipe: str = ax.RECIPE):
        self.tokenizer, self.model_type = tokenizer, model_type
        self.reward, self.env_params = ax.episode_settings(recipe)
        self.choice = FirstChoice(recipe)
        self.candidates = dict(candidates)
        self.by_message = {self.first_ids(c): name for name, c in candidates.items()}
        any_candidate = next(iter(candidates.values()))
        self.prompt = any_candidate.ids[: any_candidate.prompt_len]
        self._reference: dict[str, torch.Tensor] = {}

    @staticmethod
    def first_ids(c: ax.Candidate) -> tuple[int, ...]:
        return tuple(c.ids[i] for i in c.first_message)

    def name(self, message: tuple[int, ...]) -> str:
        """The candidate of a sampled first message, played and added on first sight."""
        if message not in self.by_message:
            from seal.cpu.warm_start import episode_tokens

            name = f"other{len(self.by_message)}"
            task_id = self.candidates["right"].task_id
            ids, mask = episode_tokens(
                task_id, self.env_params, self.tokenizer, self.model_type, first_message=list(message)
            )
            cut = mask.index(1) - len(self.prompt)  # the candidates' prompt may be cut (``apatch_exact.shortened``)
            ids, mask = ids[cut:], mask[cut:]
            if ids[: len(self.prompt)] != self.prompt:
                raise SystemExit(f"a sampled episode's prompt differs from the candidates' ({name})")
            text = self.tokenizer.decode(list(message), skip_special_tokens=True)
            evaluation = self.choice.evaluation(text, self.reward)
            scale = self.choice.scale(evaluation["tags"])
            self.candidates[name] = ax.Candidate(name, task_id, text, evaluation, scale, ids, mask)
            self.by_message[message] = name
        return self.by_message[message]

    def subset(self, rows: list[str]) -> dict[str, ax.Candidate]:
        return {name: self.candidates[name] for name in dict.fromkeys(rows)}

    def reference(self, reference_model, candidates: dict[str, ax.Candidate]) -> dict[str, torch.Tensor]:
        missing = {n: c for n, c in candidates.items() if n not in self._reference}
        if missing:
            with torch.no_grad():
                self._reference |= ax.candidate_logprobs(reference_model, missing)
        return {n: self._reference[n] for n in candidates}

    def kind(self, name: str) -> str:
        """right, heavy, light, or other (a message of none of the candidates' texts)."""
        return name if name in ax.NAMES else "other"


# ---- one arm -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SampledArm:
    metric: list[float]  # M before the first step and after each
    counts: list[dict[str, int]]  # per step: right / heavy / light / other episodes sampled
    # per step, over the batch's rows whose candidate had an advantage somewhere in it: the mean of their candidate's
    # A-Patch scale (``applied_scales``: a candidate's factor averaged over its rows with an advantage; 1.0 when off)
    mean_scales: list[float]
    other_scales: list[float | None]  # the same over the other (hybrid) rows; None when none had an advantage
    grad_norms: list[float]
    end: ax.Start | None = None


def run_sampled_arm(
    model,
    reference_model,
    start: ax.Start,
    pool: EpisodePool,
    seed: int,
    first_step: int,
    steps: int,
    overrides: list[str],
    lr: float = LIVE_LR,
    mean_one: bool = False,
    keep_end: bool = False,
    shape: tuple[int, int] | None = None,
    measure=None,
) -> SampledArm:
    """``steps`` steps of ``model`` from ``start`` (AdamW at ``lr``), each on a batch the policy samples from itself
    with the uniforms of (``seed``, step), steps numbered from ``first_step``. ``shape``: (groups, group size) of a
    batch (default the released mini-batch); ``measure(model, candidates)``: M of the model (default teacher-forced
    on ``model`` itself; the GPU script's reads an fp32 copy of its weights)."""
    actor, _ = ax.released_actor()
    groups, group_size = shape or ax.batch_shape()
    opt = ax.start_training(model, start, "adamw", actor, lr)
    named = {name: pool.candidates[name] for name in ax.NAMES}
    limit = 2 * max(len(c.first_message) for c in named.values())
    end_id = pool.tokenizer.eos_token_id

    def metric() -> float:
        if measure is not None:
            return measure(model, named)
        with torch.no_grad():
            return ax.heavy_minus_light(ax.candidate_logprobs(model, named), named)

    result = SampledArm([metric()], [], [], [], [])
    with tempfile.TemporaryDirectory(prefix="apatch-sampled-") as workdir:
        trainer = ax.seal_trainer(Path(workdir), overrides, steps_per_epoch=steps)
        for k in range(steps):
            step = first_step + k
            uniforms = step_uniforms(seed, step, groups * group_size, limit)
            rows = [pool.name(m) for m in sample_messages(model, pool.prompt, uniforms, end_id)]
            candidates = pool.subset(rows)
            with torch.no_grad():
                old = ax.candidate_logprobs(model, candidates)
            reference = pool.reference(reference_model, candidates)
            grad_norm, scales = ax.train_step(
                model, opt, trainer, k + 1, candidates, rows, group_size, old, reference, actor.optim.clip_grad,
                mean_one=mean_one,
            )  # fmt: skip
            weighed = [scales[r] for r in rows if r in scales]
            others = [scales[r] for r in rows if r in scales and pool.kind(r) == "other"]
            result.counts.append({kind: sum(pool.kind(r) == kind for r in rows) for kind in (*ax.NAMES, "other")})
            result.mean_scales.append(sum(weighed) / len(weighed) if weighed else 1.0)
            result.other_scales.append(sum(others) / len(others) if others else None)
            result.grad_norms.append(grad_norm)
            result.metric.append(metric())
    if keep_end:
        result.end = ax.Start({k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict())
    return result


# ---- one seed ----------------------------------------------------------------------------------------------------


def arm_settings(candidates: dict[str, ax.Candidate], recipe: str = ax.RECIPE) -> dict[str, tuple[list[str], bool]]:
    """Each arm's overrides and whether its scales are divided by their mean."""
    overrides = ax.arm_overrides(candidates, recipe)
    return {arm: (overrides["on" if arm == "on_mean1" else arm], arm == "on_mean1") for arm in ARMS}


def run_seed(
    model,
    reference_model,
    fresh: ax.Start,
    pool: EpisodePool,
    seed: int,
    trunk_updates: int = TRUNK_UPDATES,
    arm_updates: int = ARM_UPDATES,
    conditions: dict[str, tuple[str, ...]] = CONDITIONS,
    shape: tuple[int, int] | None = None,
    settings: dict[str, tuple[list[str], bool]] | None = None,
    measure=None,
    lr: float = LIVE_LR,
) -> dict:
    """The seed's trunk, then every condition's arms: per arm, M per step, the episodes sampled, the scales.
    ``fresh``: the warm start (its weights, no optimizer state), where the trunk and the fresh condition begin;
    ``reference_model``: the KL loss's reference policy (the warm start, frozen). ``settings``: each arm's overrides
    and mean-one switch (default ``arm_settings``); ``lr``: AdamW's, the trunk's and every arm's."""
    settings = settings or arm_settings({n: pool.candidates[n] for n in ax.NAMES})
    out: dict = {"conditions": {}}
    begins = {"fresh": (fresh, 1)}
    if "warmed" in conditions:
        trunk = run_sampled_arm(
            model, reference_model, fresh, pool, seed, 1, trunk_updates, settings["off"][0], lr=lr, keep_end=True,
            shape=shape, measure=measure,
        )  # fmt: skip
        out["trunk"] = arm_record(trunk)
        begins["warmed"] = (trunk.end, trunk_updates + 1)
    for condition, arms in conditions.items():
        begin, first_step = begins[condition]
        runs = {}
        for arm in arms:
            overrides, mean_one = settings[arm]
            r = run_sampled_arm(
                model, reference_model, begin, pool, seed, first_step, arm_updates, overrides, lr=lr,
                mean_one=mean_one, shape=shape, measure=measure,
            )  # fmt: skip
            runs[arm] = arm_record(r)
        out["conditions"][condition] = runs
    return out


def arm_record(r: SampledArm) -> dict:
    return {k: v for k, v in dataclasses.asdict(r).items() if k != "end"}


# ---- the registered rule -----------------------------------------------------------------------------------------


def contrast_values(results: dict, contrast: Contrast, condition: str = "warmed", step: int | None = None) -> list:
    """Per seed, M_a - M_b after ``step`` (default: the arms' last) in ``condition``."""
    out = []
    for r in results.values():
        arms = r["conditions"][condition]
        k = len(arms[contrast.a]["metric"]) - 1 if step is None else step
        out.append(arms[contrast.a]["metric"][k] - arms[contrast.b]["metric"][k])
    return out


def negative_control(results: dict) -> bool:
    """``ones`` equals ``off`` to the last bit in every seed: M at every step, the gradient norms, the batches (False
    where a seed did not run both: an unrun control passes nothing)."""
    keys = ("metric", "grad_norms", "counts")
    for r in results.values():
        arms = r["conditions"].get("warmed", {})
        if "ones" not in arms or "off" not in arms or any(arms["ones"][k] != arms["off"][k] for k in keys):
            return False
    return bool(results)


def verdict(results: dict) -> dict:
    """The registered rule (docs/learning-check.md): both primary contrasts below 0 by a one-sided paired t test at
    ALPHA with at least MIN_SHARE of the seeds in the predicted direction, and the negative control exact."""
    n = len(results)
    need = count_needed(n)
    tests = {}
    ran = next(iter(results.values()))["conditions"] if results else {}  # the conditions and arms the seeds ran
    for contrast in (*PRIMARY, *REPORTED):
        for condition, arms in ran.items():
            if contrast.a in arms and contrast.b in arms and n >= 2:
                test = paired_t(contrast_values(results, contrast, condition), contrast.predicted)
                tests[f"{condition}/{contrast.name}"] = test
    primary = {}
    for contrast in PRIMARY:
        test = tests.get(f"warmed/{contrast.name}")  # none with fewer than 2 seeds: nothing passes
        primary[contrast.name] = test is not None and test["p"] < ALPHA and test["count"] >= need
    control = negative_control(results)
    return {
        "seeds": n,
        "count_needed": need,
        "tests": tests,
        "primary": primary,
        "negative_control": control,
        "passed": control and all(primary.values()),
    }


def power_lines(pilot: dict, n_min: int = 10) -> tuple[list[str], int]:
    """From the pilot, the seeds the registered run needs: per primary contrast, a one-sided paired t test at ALPHA
    with 90 % power at half the pilot's effect (its standard deviation as the pilot's); and the warmed ``on - off``,
    the paper's contrast, reported two-sided at 0.05, with 90 % power at the pilot's effect in the pilot's direction.
    The registered count is the largest (at least ``n_min``)."""
    lines, needed = [f"power from the pilot's {len(pilot)} seeds (warmed, after the last step):"], [n_min]
    wanted = [(c, 2.0, ALPHA) for c in PRIMARY] + [(Contrast("on", "off", 0), 1.0, 0.025)]
    for contrast, shrink, alpha in wanted:
        test = paired_t(contrast_values(pilot, contrast), contrast.predicted)
        effect = abs(test["mean"]) if contrast.predicted == 0 else contrast.predicted * test["mean"]
        n = seeds_for_power(effect / shrink, test["sd"], alpha) if effect > 0 else None
        lines.append(
            f"  {contrast.name:14s} mean {test['mean']:+.5f} sd {test['sd']:.5f}: effect / {shrink:g}, one-sided "
            f"{alpha}, 90 % power -> {n if n is not None else 'no count (the pilot went the other way, or > 200)'} seeds"
        )
        needed.append(n if n is not None else 200)
    n = max(needed)
    lines.append(f"registered: {n} seeds (at least {n_min}); the count rule then needs {count_needed(n)}/{n}")
    return lines, n


def seed_lines(seed: int, r: dict) -> list[str]:
    """Every arm's M per step, the episodes it sampled (right/heavy/light/other per step) and its mean scale."""
    lines = [f"seed {seed} ({r.get('wall_s', 0):.0f} s)"]
    arms = {"trunk (off)": r["trunk"]} if "trunk" in r else {}
    for condition, runs in r["conditions"].items():
        arms |= {f"{condition} {arm}": run for arm, run in runs.items()}
    for name, run in arms.items():
        counts = " ".join(f"{c['right']}/{c['heavy']}/{c['light']}/{c['other']}" for c in run["counts"])
        scales = " ".join(f"{s:.2f}" for s in run["mean_scales"])
        norms = " ".join(f"{g:.2f}" for g in run["grad_norms"])
        lines.append(f"  {name:18s} M " + " ".join(f"{m:+.4f}" for m in run["metric"]))
        lines.append(f"  {'':18s} right/heavy/light/other {counts}; mean scale {scales}; gradient norm {norms}")
    for condition, runs in r["conditions"].items():
        for contrast in (*PRIMARY, *REPORTED):
            if contrast.a in runs and contrast.b in runs:
                a, b = runs[contrast.a]["metric"], runs[contrast.b]["metric"]
                lines.append(
                    f"  {condition} {contrast.name:14s} per step " + " ".join(f"{x - y:+.5f}" for x, y in zip(a, b))
                )
    return lines


def verdict_lines(v: dict) -> list[str]:
    lines = [f"over {v['seeds']} seeds (paired t; the count rule needs {v['count_needed']}/{v['seeds']}):"]
    for key, t in v["tests"].items():
        condition, name = key.split("/")
        contrast = next(c for c in (*PRIMARY, *REPORTED) if c.name == name)
        side = "one-sided, predicted < 0" if contrast.predicted else "two-sided"
        lines.append(
            f"  {condition:6s} {name:14s} mean {t['mean']:+.5f} ± {t['se']:.5f}  t {t['t']:+.2f}  p {t['p']:.2g} "
            f"({side})  below 0 in {t['count']}/{t['n']}"
        )
    lines.append(f"negative control (ones == off to the last bit, every seed): {v['negative_control']}")
    primary = ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in v["primary"].items())
    lines.append(f"primary contrasts (p < {ALPHA} and the count): {primary} -> {'PASS' if v['passed'] else 'FAIL'}")
    return lines


def contrast_figures(results: dict, out: Path) -> list[str]:
    """Per condition, each contrast's mean over the seeds (± one standard error) at every step of the arms: the
    figure of what the verdict reads at the last step."""
    from seal.report.decoy_choice import mean_se
    from seal.results.figures import reward_over_steps

    figures = []
    any_seed = next(iter(results.values()))
    trunk_steps = len(any_seed["trunk"]["metric"]) - 1 if "trunk" in any_seed else 0
    for condition, arms in any_seed["conditions"].items():
        first = trunk_steps if condition == "warmed" else 0  # the arms' steps continue the trunk's
        lines = {}
        for contrast in (*PRIMARY, *REPORTED):
            if contrast.a in arms and contrast.b in arms and contrast.name != "on_mean1-off":
                steps = range(len(arms[contrast.a]["metric"]))
                lines[f"M {contrast.a} - M {contrast.b}"] = {
                    first + k: mean_se(contrast_values(results, contrast, condition, k)) for k in steps
                }
        path = reward_over_steps(
            lines,
            str(out / f"apatch_sampled_{condition}.png"),
            ylabel="difference of log pi(heavy) - log pi(light)",
            title=f"Stage C, {condition} AdamW: the arms' differences over {len(results)} seeds (± 1 SE)",
            ylim=None,
            zero_line=True,
        )
        figures += [path] if path else []
    return figures
