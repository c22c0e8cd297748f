"""A-Patch measured exactly (Stage A of docs/learning-check.md): what a tag weight does to the policy after one and
three real updates, computed from the model, with no sampling noise.

The open first message of ``exp/cpu_learning_apatch_exact.yaml``'s task has three candidates the warm start left at
comparable probabilities: the right call, the heavy decoy (A-Patch scale 2.0) and the light decoy (0.75). Their
episodes are played through the environment's own episode code (``env_service.bfcl.episode.Episode``: token streams as
the agent loop builds them, the replies each call really gets, the verdict and the tags). A batch of them, drawn
per seed from the candidates' probabilities in the recipe's shape (``ppo_mini_batch_size`` groups of
``rollout.n``: one optimizer step), then goes through what a training step does with it:

    verl's GRPO advantage (``compute_advantage``) -> ``SealTrainer._seal_step`` (diagnosis, closed loop, A-Patch)
    -> verl's actor loss (``verl.workers.utils.losses.ppo_loss``: the released recipe's clipped, dual-clip,
    token-mean policy loss and its low-variance KL loss) -> the recipe's optimizer (verl's ``build_optimizer``:
    torch AdamW, its betas, eps and weight decay), after the engine's gradient clipping.

Each update is a training step of its own on the same batch: the old log-probabilities are the model's before it
(on-policy, as the first mini-batch of every recipe step), the SEAL step runs again (the closed loop sees the batch
once more), and the optimizer's state carries over. The reference policy of the KL loss is the warm start.

The metric is the teacher-forced change of ``log pi(heavy) - log pi(light)`` (each the log-probability of the
candidate's whole first message, its end-of-turn token included) after each update. Arms: A-Patch ``on``, ``off``
(``seal.apatch.enable: false``), ``swapped`` (the two decoys' tag weights exchanged) and ``none`` (every advantage
zeroed: the optimizer's step from its own state, so that ``off - none`` is what the batch pushed). ``ones`` (every
weight and bound 1) is the negative control: it must equal ``off`` to the last bit. Conditions: AdamW fresh (a run's
first updates) at two learning rates, AdamW warmed (its state after 20 updates), and plain SGD, the positive control.

``scripts/learning_check.py --apatch-exact`` runs the study; ``scripts/apatch_exact_gpu.py`` the same on a Qwen2.5
architecture in bf16 under FSDP2.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from seal.report.decoy_choice import FirstChoice, composed, mean_se, recipe_decoys

RECIPE = "exp/cpu_learning_apatch_exact.yaml"
#: The released recipe: its actor (policy loss, clipping, KL loss, optimizer) and its GRPO are what Stage A updates by.
ACTOR_RECIPE = "exp/SEAL.yaml"
#: The released recipe's backbone width (Qwen2.5-7B-Instruct's hidden size), for the learning-rate analogue.
RECIPE_HIDDEN_SIZE = 3584
NAMES = ("right", "heavy", "light")


@dataclasses.dataclass
class Candidate:
    """One first message of the open choice and the episode that sends it (then the ground truth's other messages)."""

    name: str
    task_id: str
    text: str
    evaluation: dict  # the environment's verdict and diagnosis of the episode (reward under the recipe's seal.reward)
    scale: float  # the A-Patch scale the recipe's static weights give its tags
    ids: list[int]  # the agent loop's token stream: prompt, then generated and environment tokens
    mask: list[int]  # 1 where the model generated the token

    @property
    def prompt_len(self) -> int:
        return self.mask.index(1)

    @property
    def model_calls(self) -> int:
        """The messages the model generated (runs of generated tokens)."""
        return sum(1 for i, m in enumerate(self.mask) if m and (i == 0 or not self.mask[i - 1]))

    @property
    def first_message(self) -> range:
        """Positions in ``ids`` of the first message's tokens (its end-of-turn token included)."""
        end = self.prompt_len
        while end < len(self.mask) and self.mask[end]:
            end += 1
        return range(self.prompt_len, end)


def episode_settings(recipe: str = RECIPE):
    """What the recipe's episodes are played and judged with: its reward (``seal.reward``, an
    ``env_service.bfcl.config.RewardConfig``) and its environment's parameters (``env_service.bfcl``)."""
    from env_service.bfcl.config import RewardConfig

    config = composed(recipe)
    reward = RewardConfig.from_dict(OmegaConf.to_container(config.seal.reward, resolve=True), path="seal.reward")
    return reward, OmegaConf.to_container(config.env_service.bfcl, resolve=True)


def load_candidates(tokenizer, model_type: str, recipe: str = RECIPE) -> dict[str, Candidate]:
    """The recipe's right first message and its two decoys, heavy and light by A-Patch scale (refused unless they
    differ: ``FirstChoice.options``), each played through the environment's episode code."""
    from seal.cpu.warm_start import episode_texts, episode_tokens

    choice = FirstChoice(recipe)
    options = choice.options()
    reward, env_params = episode_settings(recipe)
    ((task_id, (old, *wrong)),) = recipe_decoys(recipe).items()
    decoy_of = {episode_texts(choice.task, choice.env.tool_prompt_mode, None)[0]: None}
    decoy_of.update({episode_texts(choice.task, choice.env.tool_prompt_mode, (old, w))[0]: (old, w) for w in wrong})
    candidates = {}
    for name in NAMES:
        option = options[name]
        ids, mask = episode_tokens(task_id, env_params, tokenizer, model_type, decoy_of[option["text"]])
        evaluation = choice.evaluation(option["text"], reward)
        candidates[name] = Candidate(name, task_id, option["text"], evaluation, option["scale"], ids, mask)
    if [candidates[n].evaluation["reward"] for n in NAMES] != [1.0, 0.0, 0.0]:
        raise SystemExit(f"the right candidate must pass and the decoys fail: {candidates}")
    return candidates


def decoy_tag(candidate: Candidate) -> str:
    """The one failure tag a decoy's episode earns (its turns are that tag or ``pass``)."""
    tags = set(candidate.evaluation["tags"]) - {"pass"}
    if len(tags) != 1:
        raise SystemExit(f"the {candidate.name} decoy must earn exactly one failure tag, got {tags}")
    return tags.pop()


def arm_overrides(candidates: dict[str, Candidate], recipe: str = RECIPE) -> dict[str, list[str]]:
    """Each arm's overrides of the recipe's ``seal.apatch`` block."""
    weights = composed(recipe).seal.apatch.tag_weights
    heavy, light = decoy_tag(candidates["heavy"]), decoy_tag(candidates["light"])
    return {
        "on": [],
        "off": ["seal.apatch.enable=false"],
        # A-Patch on with the decoys' two tags weighted 1: every other tag (the hybrids' among them) as in ``on``
        "neutral": [f"seal.apatch.tag_weights.{heavy}=1.0", f"seal.apatch.tag_weights.{light}=1.0"],
        "swapped": [
            f"seal.apatch.tag_weights.{heavy}={weights[light]}",
            f"seal.apatch.tag_weights.{light}={weights[heavy]}",
        ],
        # the negative control: A-Patch on, every tag weight and both bounds 1 (the closed loop cannot move a weight)
        "ones": [
            *(f"seal.apatch.tag_weights.{tag}=1.0" for tag in weights),
            "seal.apatch.min_scale=1.0",
            "seal.apatch.max_scale=1.0",
        ],
    }


# ---- the model's side ----------------------------------------------------------------------------------------


def candidate_logprobs(model, candidates: dict[str, Candidate], shared_prefix: bool = True) -> dict[str, torch.Tensor]:
    """Per candidate, the next-token log-probabilities along its sequence, in the layout verl's engine returns them
    (no padding: position j holds log p(ids[j + 1] | ids[: j + 1])), at the released recipe's temperature 1.0.
    Only the response's are computed: the prompt's positions but its last hold 0, as does the sequence's last
    (the actor's loss reads the response's positions only: ``no_padding_2_padding``).

    ``shared_prefix``: the prompt, which the candidates share, runs once and its keys and values serve every
    candidate's response (``seal.cpu.warm_start.shared_prefix_loss`` does the same for the warm start; gradients
    flow through the shared prompt as through each candidate's own copy). Else each sequence runs whole."""
    from verl.utils.torch_functional import logprobs_from_logits

    device = next(model.parameters()).device
    prompt_len = {c.prompt_len for c in candidates.values()}
    prompts = {tuple(c.ids[: c.prompt_len]) for c in candidates.values()}
    if len(prompts) != 1:
        raise ValueError(f"the candidates' prompts differ ({len(prompts)} prompts, lengths {sorted(prompt_len)})")
    (prompt_len,) = prompt_len
    sequences = {name: torch.tensor(c.ids, device=device) for name, c in candidates.items()}
    if shared_prefix:
        prompt = next(iter(sequences.values()))[None, :prompt_len]
        prefix = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        last_prompt_logits, cache = prefix.logits[0], prefix.past_key_values
    out = {}
    for name, ids in sequences.items():
        if shared_prefix:
            response = model(input_ids=ids[None, prompt_len:], past_key_values=cache, use_cache=True).logits[0]
            logits = torch.cat([last_prompt_logits, response[:-1]])
            cache.crop(prompt_len)  # back to the prompt for the next candidate
        else:
            logits = model(input_ids=ids[None], use_cache=False).logits[0, prompt_len - 1 : -1]
        logprobs = logprobs_from_logits(logits.float(), ids[prompt_len:])
        out[name] = torch.cat([logprobs.new_zeros(prompt_len - 1), logprobs, logprobs.new_zeros(1)])
    return out


def first_message_logprob(logprobs: dict[str, torch.Tensor], candidate: Candidate) -> float:
    """log pi(the candidate's first message | prompt), teacher-forced."""
    positions = torch.tensor(list(candidate.first_message)) - 1
    return float(logprobs[candidate.name][positions.to(logprobs[candidate.name].device)].double().sum())


def heavy_minus_light(logprobs: dict[str, torch.Tensor], candidates: dict[str, Candidate]) -> float:
    """The metric: log pi(heavy) - log pi(light), each the log-probability of the decoy's whole first message."""
    return first_message_logprob(logprobs, candidates["heavy"]) - first_message_logprob(logprobs, candidates["light"])


def candidate_probabilities(model, candidates: dict[str, Candidate], shared_prefix: bool = True) -> dict[str, float]:
    """pi(each candidate's first message | prompt), teacher-forced."""
    with torch.no_grad():
        logprobs = candidate_logprobs(model, candidates, shared_prefix)
    return {name: math.exp(first_message_logprob(logprobs, c)) for name, c in candidates.items()}


# ---- the batch ---------------------------------------------------------------------------------------------


def draw_rows(probabilities: dict[str, float], seed: int, groups: int, group_size: int) -> list[str]:
    """The candidate of each episode of a batch: ``groups`` GRPO groups of ``group_size``, drawn from the
    candidates' probabilities (renormalised over the three) with ``seed``."""
    names = list(probabilities)
    weights = torch.tensor([probabilities[n] for n in names], dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.multinomial(weights, groups * group_size, replacement=True, generator=generator).tolist()
    return [names[i] for i in drawn]


def make_batch(candidates: dict[str, Candidate], rows: list[str], group_size: int):
    """The ``DataProto`` verl's trainer holds after the rollout: the agent loop's tensors (prompt, response, masks,
    positions, the verdict as the last response token's score) and its ``seal_*`` diagnosis fields, rows grouped
    ``group_size`` at a time under one ``uid`` (one prompt's rollouts)."""
    import numpy as np
    from verl import DataProto

    from seal.agent_loop import diagnosis_fields

    prompt_len = {c.prompt_len for c in candidates.values()}
    if len(prompt_len) != 1:
        raise SystemExit(f"the candidates' prompts differ in length: {prompt_len}")
    (prompt_len,) = prompt_len
    response_len = max(len(c.ids) - prompt_len for c in candidates.values())
    n = len(rows)
    prompts = torch.zeros(n, prompt_len, dtype=torch.long)
    responses = torch.zeros(n, response_len, dtype=torch.long)
    response_mask = torch.zeros(n, response_len, dtype=torch.long)
    attention = torch.zeros(n, prompt_len + response_len, dtype=torch.long)
    scores = torch.zeros(n, response_len)
    fields: dict[str, list] = {}
    for i, name in enumerate(rows):
        c = candidates[name]
        length = len(c.ids) - prompt_len
        prompts[i] = torch.tensor(c.ids[:prompt_len])
        responses[i, :length] = torch.tensor(c.ids[prompt_len:])
        response_mask[i, :length] = torch.tensor(c.mask[prompt_len:])
        attention[i, : prompt_len + length] = 1
        scores[i, length - 1] = float(c.evaluation["reward"])
        row = diagnosis_fields(c.task_id, c.evaluation.get("category"), c.evaluation, c.model_calls, "completed")
        for key, value in row.items():
            fields.setdefault(key, []).append(value)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)

    def objects(values):  # keep lists as list objects, one per row
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array

    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": position_ids,
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
        },
        non_tensors={"uid": objects([str(i // group_size) for i in range(n)])}
        | {key: objects(values) for key, values in fields.items()},
    )


# ---- one arm ----------------------------------------------------------------------------------------------------


def seal_trainer(workdir: Path, overrides: list[str], steps_per_epoch: int, recipe: str = RECIPE):
    """The SEAL part of ``SealTrainer`` on the recipe (no Ray workers behind it): ``_seal_step`` as a run calls it,
    its capability state and diagnosis dumps under ``workdir``."""
    from seal.trainer import SealTrainer

    config = copy.deepcopy(composed(recipe, tuple(overrides)))
    config.seal.run_dir = str(workdir)
    config.seal.diagnosis.state_dir = f"{workdir}/state"
    config.seal.diagnosis.dump_dir = f"{workdir}/stats"
    config.trainer.default_local_dir = f"{workdir}/ckpt"
    OmegaConf.resolve(config)
    return SealTrainer.seal_parts_only(config, steps_per_epoch)


@functools.cache
def released_actor():
    """The released recipe's actor config (verl's dataclass: policy loss, clipping, KL loss, optimizer) and GRPO."""
    from verl.utils.config import omega_conf_to_dataclass

    config = composed(ACTOR_RECIPE)
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor), config.algorithm


def make_optimizer(kind: str, parameters, actor, lr: float):
    """``adamw``: verl's ``build_optimizer`` with the released recipe's optimizer config at ``lr``; ``sgd``: plain
    SGD (no momentum, no weight decay), the positive control."""
    if kind == "adamw":
        from verl.workers.config.optimizer import build_optimizer

        return build_optimizer(parameters, dataclasses.replace(actor.optim, lr=lr))
    if kind == "sgd":
        return torch.optim.SGD(parameters, lr=lr)
    raise ValueError(f"optimizer must be adamw or sgd, got {kind!r}")


@dataclasses.dataclass
class Start:
    """Where an arm starts: the weights, the optimizer's state (None: a fresh optimizer, as at a run's first update)
    and the reference policy's log-probabilities for the KL loss (None: those of ``weights``)."""

    weights: dict[str, torch.Tensor]
    optimizer: dict | None = None
    reference: dict[str, torch.Tensor] | None = None


@dataclasses.dataclass
class ArmResult:
    metric: list[float]  # heavy_minus_light before the first update and after each
    scales: list[dict[str, float]]  # per update: the scale A-Patch applied to each candidate's rows (1.0 when off)
    grad_norms: list[float]
    end: Start | None = None  # where the arm ended, when asked for (the bit-exact control, a warmed optimizer)

    def change(self, updates: int) -> float:
        return self.metric[updates] - self.metric[0]


def run_arm(
    model,
    start: Start,
    candidates: dict[str, Candidate],
    rows: list[str],
    group_size: int,
    overrides: list[str],
    optimizer: str,
    lr: float,
    updates: int,
    keep_end: bool = False,
    shared_prefix: bool = True,
    zero_advantages: bool = False,
) -> ArmResult:
    """``updates`` training steps of ``model`` from ``start`` on the batch ``rows``, A-Patch configured by
    ``overrides``; the metric before and after each. ``zero_advantages``: every advantage 0 after the SEAL step,
    the step the optimizer takes from its own state alone (momentum, weight decay) and the KL loss."""
    from seal.advantage import SEAL_GRPO  # registers the recipe's estimator with verl

    actor, algorithm = released_actor()
    if algorithm.adv_estimator != SEAL_GRPO:
        raise SystemExit(f"the released recipe's estimator is {algorithm.adv_estimator}, Stage A expects {SEAL_GRPO}")
    opt = start_training(model, start, optimizer, actor, lr)
    max_norm = actor.optim.clip_grad if optimizer == "adamw" else math.inf  # SGD: the control, unclipped

    with torch.no_grad():
        current = candidate_logprobs(model, candidates, shared_prefix)
    reference = start.reference or current
    result = ArmResult([heavy_minus_light(current, candidates)], [], [])
    with tempfile.TemporaryDirectory(prefix="apatch-exact-") as workdir:
        trainer = seal_trainer(Path(workdir), overrides, steps_per_epoch=updates)
        for step in range(1, updates + 1):
            grad_norm, scales = train_step(
                model,
                opt,
                trainer,
                step,
                candidates,
                rows,
                group_size,
                current,
                reference,
                max_norm,
                shared_prefix=shared_prefix,
                zero_advantages=zero_advantages,
            )
            result.scales.append(scales)
            result.grad_norms.append(grad_norm)
            with torch.no_grad():
                current = candidate_logprobs(model, candidates, shared_prefix)
            result.metric.append(heavy_minus_light(current, candidates))
    if keep_end:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result.end = Start(weights, copy.deepcopy(opt.state_dict()), reference)
    return result


def start_training(model, start: Start, optimizer: str, actor, lr: float):
    """``model`` at ``start``'s weights in training mode, and its optimizer (``make_optimizer``) with ``start``'s state
    (a copy: the start serves every arm) at ``lr``."""
    model.load_state_dict(start.weights)
    model.train()
    opt = make_optimizer(optimizer, model.parameters(), actor, lr)
    if start.optimizer is not None:
        opt.load_state_dict(copy.deepcopy(start.optimizer))
        for group in opt.param_groups:
            group["lr"] = lr
    return opt


def train_step(
    model,
    opt,
    trainer,
    step: int,
    candidates: dict[str, Candidate],
    rows: list[str],
    group_size: int,
    old: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    max_norm: float,
    shared_prefix: bool = True,
    zero_advantages: bool = False,
    mean_one: bool = False,
) -> tuple[float, dict[str, float]]:
    """One training step of ``model`` on the batch ``rows`` (names of ``candidates``, ``group_size`` to a GRPO
    group): verl's GRPO advantage, ``trainer._seal_step`` (diagnosis, closed loop, A-Patch), verl's actor loss with
    ``old`` and ``reference`` the old and the reference policy's log-probabilities, the engine's clipping at
    ``max_norm`` and ``opt``'s step. Returns the gradient norm and the factor A-Patch scaled each candidate's
    advantages by. ``zero_advantages``: every advantage 0 after the SEAL step (the optimizer's step from its own
    state and the KL loss); ``mean_one``: A-Patch's scales divided by their mean over the batch's rows (the weights'
    relative effect without their mean's)."""
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    actor, algorithm = released_actor()

    def flat(logprobs):
        return torch.cat([logprobs[name] for name in rows])

    batch = make_batch(candidates, rows, group_size)
    batch = compute_advantage(batch, algorithm.adv_estimator, config=algorithm)
    grpo = batch.batch["advantages"].clone()
    trainer.global_steps = step
    trainer._seal_step(batch)
    if mean_one:
        batch.batch["advantages"] = batch.batch["advantages"] / mean_scale(grpo, batch.batch["advantages"])
    scales = applied_scales(grpo, batch.batch["advantages"], rows)
    if zero_advantages:
        batch.batch["advantages"] = torch.zeros_like(batch.batch["advantages"])
    data = left_right_2_no_padding(batch.to_tensordict()).to(next(model.parameters()).device)
    data["old_log_probs"] = no_padding_2_padding(flat(old), data)
    data["ref_log_prob"] = no_padding_2_padding(flat(reference), data)
    # what the engine adds before its micro-batches (one data-parallel rank: the whole mini-batch here)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), global_batch_size=len(rows))
    opt.zero_grad()
    loss, _ = ppo_loss(actor, {"log_probs": flat(candidate_logprobs(model, candidates, shared_prefix))}, data)
    loss.backward()
    return clip_and_step(model, opt, max_norm), scales


def clip_and_step(model, optimizer, max_norm: float) -> float:
    """The FSDP engine's ``optimizer_step``: clip the gradient norm (verl's FSDP2 clipping for a sharded module),
    skip a non-finite update; returns the norm before clipping. ``max_norm`` inf: not clipped (the SGD control:
    clipping would rescale each arm by its own gradient's norm)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from verl.utils.fsdp_utils import fsdp2_clip_grad_norm_

    clip = fsdp2_clip_grad_norm_ if isinstance(model, FSDPModule) else torch.nn.utils.clip_grad_norm_
    grad_norm = clip(model.parameters(), max_norm=max_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        optimizer.zero_grad()
    return float(grad_norm)


def row_factors(before: torch.Tensor, after: torch.Tensor) -> list[float | None]:
    """Per row, the factor its advantages were multiplied by (None: a row with no advantage, its group all passed or
    all failed)."""
    return [float(a.sum() / b.sum()) if b.abs().sum() > 0 else None for b, a in zip(before, after)]


def applied_scales(before: torch.Tensor, after: torch.Tensor, rows: list[str]) -> dict[str, float]:
    """The factor A-Patch multiplied each candidate's advantages by (the mean over its rows with an advantage)."""
    out: dict[str, list[float]] = {}
    for name, factor in zip(rows, row_factors(before, after)):
        if factor is not None:
            out.setdefault(name, []).append(factor)
    return {name: sum(f) / len(f) for name, f in out.items()}


def mean_scale(before: torch.Tensor, after: torch.Tensor) -> float:
    """A-Patch's mean scale over a batch's rows with an advantage (1.0 when none has one)."""
    factors = [f for f in row_factors(before, after) if f is not None]
    return sum(factors) / len(factors) if factors else 1.0


def lr_analogue(hidden_size: int, recipe_lr: float) -> float:
    """The tiny model's analogue of the released learning rate: Adam moves every weight by about ``lr`` a step,
    and a matrix of fan-in ``d`` moves its outputs by about ``lr * d`` (the sum of ``d`` such changes), so the
    same change of the logits needs ``lr`` proportional to ``1 / width`` (the muP rule for Adam's hidden matrices)."""
    return recipe_lr * RECIPE_HIDDEN_SIZE / hidden_size


def shortened(candidates: dict[str, Candidate], prompt_tokens: int) -> dict[str, Candidate]:
    """The candidates with their shared prompt cut to its last ``prompt_tokens`` tokens: the same episodes, tags and
    verdicts on a short context, for checks of the pipeline that do not need the whole prompt (the controls' tests,
    the GPU script's CPU smoke run): the prompt's 3.3k tokens are most of an update's cost."""
    out = {}
    for name, c in candidates.items():
        cut = max(c.prompt_len - prompt_tokens, 0)
        out[name] = dataclasses.replace(c, ids=c.ids[cut:], mask=c.mask[cut:])
    return out


# ---- the study --------------------------------------------------------------------------------------------------

#: The small learning rate: the released recipe's own number, ~28 times below the tiny model's analogue (near the
#: linear regime of every update).
SMALL_LR = 1e-6
#: The positive control's plain SGD step size: its step is about as long as AdamW's at the analogue (~0.02 in
#: parameter norm: AdamW moves each of the ~0.6M weights by about the learning rate, SGD by 0.05 x a gradient of
#: norm ~0.4).
SGD_LR = 0.05
UPDATES = 3
#: The warmed optimizer: AdamW's state after this many updates (A-Patch off, at SMALL_LR, on the batch of
#: WARMUP_SEED), so that its second moment holds a history as it does after a run's first updates.
WARMUP_UPDATES = 20
WARMUP_SEED = 0
#: ``none``: every advantage zeroed, the step the optimizer takes from its state alone (momentum, weight decay) and
#: the KL loss: what the batch itself pushed is ``off - none``.
STUDIED_ARMS = ("on", "off", "swapped", "none")
PILOT_SEEDS = (1001, 1002, 1003, 1004, 1005)
#: The registered run's batch seeds: as many as the pilot's power computation asked for, and at least 20
#: (docs/learning-check.md; disjoint from the pilot's, the warm-up's and the calibration's 998 and 999).
REGISTERED_SEEDS = tuple(range(1, 21))


@dataclasses.dataclass(frozen=True)
class Condition:
    optimizer: str  # adamw | sgd
    lr: float
    warmed: bool = False  # start from the warmed optimizer (else a fresh one, as at a run's first update)


def conditions(hidden_size: int) -> dict[str, Condition]:
    """AdamW, fresh, at the released learning rate's analogue for this width and at the small one; AdamW warmed, at
    the small one; the SGD control."""
    recipe_lr = float(composed(ACTOR_RECIPE).actor_rollout_ref.actor.optim.lr)
    return {
        "adamw_recipe": Condition("adamw", lr_analogue(hidden_size, recipe_lr)),
        "adamw_small": Condition("adamw", SMALL_LR),
        "adamw_warmed": Condition("adamw", SMALL_LR, warmed=True),
        "sgd": Condition("sgd", SGD_LR),
    }


def batch_shape() -> tuple[int, int]:
    """(groups, group size) of one update: the released recipe's mini-batch (``ppo_mini_batch_size`` prompts of
    ``rollout.n`` rollouts), one optimizer step."""
    config = composed(ACTOR_RECIPE).actor_rollout_ref
    return int(config.actor.ppo_mini_batch_size), int(config.rollout.n)


def warm_model(recipe: str = RECIPE):
    """The recipe's warm-started tiny model and its tokenizer, built and cached on first use as the launcher does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seal.launch.recipe import prepare

    config = copy.deepcopy(composed(recipe))
    prepare(config)
    path = str(config.actor_rollout_ref.model.path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def starts(model, candidates, probabilities) -> dict[str, Start]:
    """``fresh``: the warm start's weights and a fresh optimizer; ``warmed``: where WARMUP_UPDATES AdamW updates
    (A-Patch off) at SMALL_LR on the batch of WARMUP_SEED leave the weights and the optimizer (the KL loss's
    reference stays the warm start)."""
    groups, group_size = batch_shape()
    fresh = Start({k: v.detach().clone() for k, v in model.state_dict().items()})
    rows = draw_rows(probabilities, WARMUP_SEED, groups, group_size)
    off = arm_overrides(candidates)["off"]
    warmup = run_arm(model, fresh, candidates, rows, group_size, off, "adamw", SMALL_LR, WARMUP_UPDATES, keep_end=True)
    return {"fresh": fresh, "warmed": warmup.end}


def run_seed(model, begin: dict[str, Start], candidates, probabilities, seed: int, conds, updates=UPDATES) -> dict:
    """Every condition's arms on the batch ``seed`` draws: the metric per update, the scales A-Patch applied, the
    gradient norms."""
    groups, group_size = batch_shape()
    rows = draw_rows(probabilities, seed, groups, group_size)
    arms = arm_overrides(candidates)
    result = {"batch": {name: rows.count(name) for name in NAMES}, "conditions": {}}
    for name, c in conds.items():
        runs = {}
        for arm in STUDIED_ARMS:
            start = begin["warmed" if c.warmed else "fresh"]
            overrides = arms["off" if arm == "none" else arm]
            r = run_arm(
                model,
                start,
                candidates,
                rows,
                group_size,
                overrides,
                c.optimizer,
                c.lr,
                updates,
                zero_advantages=arm == "none",
            )
            runs[arm] = {"metric": r.metric, "scales": r.scales, "grad_norms": r.grad_norms}
        result["conditions"][name] = dataclasses.asdict(c) | {"arms": runs}
    return result


def changes(seed_result: dict, condition: str, updates: int) -> dict[str, float]:
    """After ``updates`` updates: each arm's change of the metric; ``batch``, what the batch itself pushed
    (``off - none``); the paired differences from ``off`` (``on-off``, ``swapped-off``) and the same relative to
    the batch's push (``r_on``, ``r_swapped``: -1 would be A-Patch doubling the push, 0 no effect)."""
    arms = seed_result["conditions"][condition]["arms"]
    d = {arm: r["metric"][updates] - r["metric"][0] for arm, r in arms.items()}
    d["batch"] = d["off"] - d["none"]
    for arm in ("on", "swapped"):
        d[f"{arm}-off"] = d[arm] - d["off"]
        d[f"r_{arm}"] = d[f"{arm}-off"] / abs(d["batch"])
    return d


def seed_lines(seed: int, seed_result: dict, updates: tuple[int, ...] = (1, UPDATES)) -> list[str]:
    batch = "/".join(str(seed_result["batch"][n]) for n in NAMES)
    lines = [f"seed {seed}: batch right/heavy/light {batch}"]
    for condition, c in seed_result["conditions"].items():
        parts = []
        for k in updates:
            d = changes(seed_result, condition, k)
            parts.append(
                f"after {k}: on {d['on']:+.4f} off {d['off']:+.4f} swapped {d['swapped']:+.4f} none {d['none']:+.4f}"
                f" (on-off {d['on-off']:+.4f} = {d['r_on']:+.2f} of the batch's push, swapped-off "
                f"{d['swapped-off']:+.4f} = {d['r_swapped']:+.2f})"
            )
        lines.append(f"  {condition:12s} ({c['optimizer']}, lr {c['lr']:.2g})  " + "  |  ".join(parts))
    return lines


def summary_lines(results: dict[int, dict]) -> list[str]:
    """Per condition and number of updates: the mean (± SE) over the seeds of the batch's push and of the relative
    effects, and how many seeds had each effect in the predicted direction (on below off, swapped above off)."""
    first = next(iter(results.values()))
    lines = [f"over {len(results)} seeds (mean ± SE; predicted direction: r_on < 0, r_swapped > 0):"]
    for condition in first["conditions"]:
        for k in (1, UPDATES):
            d = [changes(r, condition, k) for r in results.values()]
            stats = {
                key: mean_se([x[key] for x in d]) for key in ("batch", "on-off", "swapped-off", "r_on", "r_swapped")
            }
            below = sum(x["r_on"] < 0 for x in d)
            above = sum(x["r_swapped"] > 0 for x in d)
            lines.append(
                f"  {condition:12s} after {k}: "
                + " ".join(f"{key} {m:+.4f}±{se:.4f}" for key, (m, se) in stats.items())
                + f"  on<off in {below}/{len(d)}, swapped>off in {above}/{len(d)}"
            )
    return lines


# ---- the registered test (docs/learning-check.md, committed with the pilot before the registered run) ----------

#: Each sign test's one-sided level: 0.05 over the 8 tests (4 conditions x 2 arms), Bonferroni.
ALPHA = 0.05 / 8
#: A relative effect's transmission (AdamW's over SGD's, per seed) at or above this: the scales pass through.
TRANSMITS = 0.5
#: The predicted direction of each arm's relative effect: A-Patch on pushes the heavy decoy down harder (r_on < 0),
#: the swapped weights push the light one harder (r_swapped > 0).
PREDICTED = {"on": -1, "swapped": +1}


def sign_test_threshold(n: int, alpha: float = ALPHA) -> int:
    """The fewest of ``n`` seeds in the predicted direction that a one-sided sign test at ``alpha`` accepts."""
    tail = 0.0
    for c in range(n, -1, -1):
        tail += math.comb(n, c) / 2**n
        if tail > alpha:
            return c + 1
    return 0


def sign_test_power(n: int, p: float, alpha: float = ALPHA) -> float:
    """P(at least ``sign_test_threshold(n)`` of ``n`` seeds in the predicted direction) when each is with ``p``."""
    c = sign_test_threshold(n, alpha)
    return sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(c, n + 1))


def relative_effects(results: dict, condition: str, updates: int = UPDATES) -> dict[str, list[float]]:
    """Per arm (on, swapped): each seed's relative effect ``r`` (the paired difference from off over the batch's
    push)."""
    d = [changes(r, condition, updates) for r in results.values()]
    return {arm: [x[f"r_{arm}"] for x in d] for arm in PREDICTED}


def transmissions(results: dict, condition: str, updates: int = UPDATES) -> dict[str, list[float]]:
    """Per arm: each seed's AdamW relative effect over the SGD control's on the same batch: 1 is what the scales
    imply (SGD passes them through), 0 nothing."""
    adam, sgd = relative_effects(results, condition, updates), relative_effects(results, "sgd", updates)
    return {arm: [a / s for a, s in zip(adam[arm], sgd[arm])] for arm in PREDICTED}


def median(values: list[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def power_lines(pilot: dict, n_min: int = 20, n_max: int = 100) -> tuple[list[str], int]:
    """From the pilot: the seeds each registered test needs, and the registered number (at least ``n_min``).

    Sign tests: each seed's relative effect is taken as normal with the pilot's mean and standard deviation, so a
    seed lands in the predicted direction with p = Phi(mean / sd) (signed by the prediction); the seeds needed are
    the fewest for 90 % power at ALPHA with the effect halved (p = Phi(mean / 2 sd)). Transmission: the seeds for
    the median's 95 % interval (1.96 x 1.2533 sd / sqrt(n), the normal approximation) to exclude TRANSMITS when the
    median is the pilot's."""
    from statistics import NormalDist, stdev

    phi = NormalDist().cdf
    lines, needed = [f"power from the pilot's {len(pilot)} seeds (after {UPDATES} updates):"], [n_min]
    for condition in ("sgd", "adamw_recipe", "adamw_small", "adamw_warmed"):
        r = relative_effects(pilot, condition)
        t = transmissions(pilot, condition) if condition != "sgd" else None
        for arm, sign in PREDICTED.items():
            mean, sd = sum(r[arm]) / len(r[arm]), stdev(r[arm])
            p_half = phi(sign * mean / (2 * sd))
            n_sign = next((n for n in range(5, n_max + 1) if sign_test_power(n, p_half) >= 0.9), None)
            line = (
                f"  {condition:12s} r_{arm:8s} mean {mean:+.3f} sd {sd:.3f}: p(halved) {p_half:.3f} -> {n_sign} seeds"
            )
            needed.append(n_sign or n_max)
            if t is not None:
                m, sd_t = median(t[arm]), stdev(t[arm])
                n_t = math.ceil((1.96 * 1.2533 * sd_t / abs(m - TRANSMITS)) ** 2) if m != TRANSMITS else n_max
                line += f"; transmission median {m:.2f} sd {sd_t:.2f} -> {n_t} seeds"
                needed.append(min(n_t, n_max))
            lines.append(line)
    n = max(needed)
    lines.append(f"registered: {n} seeds (at least {n_min}); a sign test then needs {sign_test_threshold(n)}/{n}")
    return lines, n


def verdict(results: dict) -> dict:
    """The registered rule (docs/learning-check.md). Per condition: each arm's sign test (seeds in the predicted
    direction against ``sign_test_threshold``) and, for AdamW, the median transmission; a condition shows the link
    when both sign tests pass, and passes it through when both medians are at least TRANSMITS. The SGD control must
    show the link, or the study says nothing. The link survives AdamW when the warmed optimizer passes it through:
    the optimizer's state of every update after a run's first few."""
    n = len(results)
    need = sign_test_threshold(n)
    out: dict = {"seeds": n, "sign_test_needs": need, "conditions": {}}
    for condition in ("sgd", "adamw_recipe", "adamw_small", "adamw_warmed"):
        r = relative_effects(results, condition)
        c = {f"{arm}_in_direction": sum(sign * x > 0 for x in r[arm]) for arm, sign in PREDICTED.items()}
        c["link"] = all(c[f"{arm}_in_direction"] >= need for arm in PREDICTED)
        if condition != "sgd":
            t = transmissions(results, condition)
            c |= {f"{arm}_transmission_median": median(t[arm]) for arm in PREDICTED}
            c["passes_through"] = c["link"] and all(c[f"{arm}_transmission_median"] >= TRANSMITS for arm in PREDICTED)
        out["conditions"][condition] = c
    out["control_holds"] = out["conditions"]["sgd"]["link"]
    out["survives_adamw"] = out["control_holds"] and out["conditions"]["adamw_warmed"]["passes_through"]
    return out


def verdict_lines(v: dict) -> list[str]:
    lines = [f"registered rule over {v['seeds']} seeds (a sign test needs {v['sign_test_needs']}/{v['seeds']}):"]
    for condition, c in v["conditions"].items():
        line = (
            f"  {condition:12s} r_on < 0 in {c['on_in_direction']}/{v['seeds']}, r_swapped > 0 in "
            f"{c['swapped_in_direction']}/{v['seeds']}: link {'yes' if c['link'] else 'NO'}"
        )
        if "passes_through" in c:
            line += (
                f"; transmission median on {c['on_transmission_median']:.2f}, swapped "
                f"{c['swapped_transmission_median']:.2f}: passes through {'yes' if c['passes_through'] else 'no'}"
            )
        lines.append(line)
    lines.append(f"positive control holds: {v['control_holds']}; the link survives AdamW: {v['survives_adamw']}")
    return lines
