#!/usr/bin/env python
"""Stage C of the A-Patch check (docs/learning-check.md, ``scripts/apatch_sampled.py``) on the released recipe's
backbone class, a Qwen2.5-0.5B shape under verl's FSDP2 engine, for a lent GPU.

    python scripts/apatch_exact_gpu.py --out experiments/apatch_exact_gpu     # one GPU: the registered GPU run
    python scripts/apatch_exact_gpu.py --smoke --out /tmp/apatch_exact_smoke  # CPU, reduced: that it runs through

**What it measures.** What A-Patch's tag weights do to a policy that samples its own episodes: M = log pi(heavy
decoy) - log pi(light decoy), teacher-forced (``apatch_exact.heavy_minus_light``), after every step of every arm,
on a model of the Qwen2.5 architecture as verl's FSDP2 engine trains it:

1. a Qwen2.5-0.5B-shaped model (``QWEN25_05B``: 24 layers, hidden 896), randomly initialised, with the tiny CPU
   model's small BFCL vocabulary (``seal.cpu.tiny_model.build_tokenizer("bfcl_bpe")``: the machine reaches no hub);
2. a warm start on the three candidates' episodes (``seal.cpu.warm_start.fit_examples``, in bf16 autocast without
   its weight cache, which would keep the first step's bf16 weights for every step); the candidates' probabilities
   after it are printed and recorded (on the GPU model not yet seen: the design means most when the three hold
   much of the probability between them, as in the CPU pilot, where about half of what is sampled is neither);
3. FSDP2 as verl's engine applies it (``verl.utils.fsdp_utils.apply_fsdp2``: fp32 master weights, bf16 parameters
   in the forward, fp32 gradient reduction), on a one-process group.

**The design** is Stage C's, unchanged (``apatch_sampled.run_seed``): per seed, a trunk of ``TRUNK_UPDATES`` steps
with A-Patch off from the warm start (its AdamW state kept), then each arm ``ARM_UPDATES`` steps from the trunk (the
"warmed" condition); every step the policy samples its own mini-batch of the released shape at temperature 1
(inverse-CDF sampling with the same uniforms for every arm at a given (seed, step): common random numbers), each
distinct first message is played through the environment's episode code (``apatch_sampled.EpisodePool``), and the
update is Stage A's (verl's GRPO, ``SealTrainer._seal_step``, verl's actor loss with its KL loss against the warm
start, the released AdamW after the engine's clipping), here on the FSDP2 module. The arms: ``on``, ``neutral``,
``swapped``, ``off`` and the negative control ``ones``; ``--fresh`` adds the "fresh" condition
(``apatch_sampled.FRESH_ARMS`` from the warm start with a fresh AdamW). The KL loss's reference policy is a frozen,
unsharded copy of the warm start with bf16 parameters (what verl's reference worker computes with under its FSDP
mixed precision). The learning rate is the released 1e-6's analogue for the model's width
(``apatch_exact.lr_analogue``: 4e-6 at 896; ``apatch_sampled.LIVE_LR`` is the tiny CPU model's).

**M from fp32 weights.** The policy's forward runs in bf16, but M is read from its fp32 master weights: after every
step each sharded parameter is gathered whole (``DTensor.full_tensor``), loaded into one plain fp32 model of the
same config (built once, no FSDP, no autocast, TF32 off) and M computed there under ``torch.no_grad()``. One update
at a learning rate ~1e-6 moves a weight by ~3 % of a bf16 rounding step: a bf16 read would not see it.

**Determinism is enforced**, not requested: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set before CUDA is initialised,
``torch.use_deterministic_algorithms(True)`` (no ``warn_only``: an op with no deterministic kernel stops the run
with its error), cuDNN benchmarking off, ``VERL_DISABLE_FLASH_ATTN_CE=1`` (verl's log-probs without flash-attn's
nondeterministic cross-entropy). Before the warm start the sampler runs once on the device, so that a refusal there
surfaces in seconds. At start-up the script also checks that the FSDP2 module takes back its own DTensor state dict
and that AdamW's state dict round-trips (``copy.deepcopy``, ``load_state_dict``) bit for bit, as the arms rely on.

**Seeds and rule.** ``GPU_SEEDS`` (6001-6004), used nowhere else (the CPU pilot's are 3001-3005, the CPU registered
run's in the 4000s). The rule is ``apatch_sampled.verdict`` on them: the contrasts on - neutral and on - swapped in
the warmed condition, each below 0 by a one-sided paired t test at ``apatch_sampled.ALPHA`` with at least
``MIN_SHARE`` of the seeds in the predicted direction, and the negative control (``ones`` equals ``off`` to the last
bit: M at every step, the gradient norms, the episodes sampled) in every seed.

**Exit status**: 0 when the rule passes; 1 when it fails, when the negative control is not exact in a seed, or when
an arm does not start where its condition starts (the checks that the arms are measured at all). ``--seeds`` other
than ``GPU_SEEDS`` or changed ``--trunk-updates``/``--arm-updates`` are not the registered run (said so; the same
exit rule). Every arm's M per step, the verdict and its tests are printed, and ``<out>/apatch_exact_gpu.json``
(device, shape, warm-start loss, the candidates' probabilities, every seed's results, the verdict, wall time) is
written after every seed, so that a timeout loses only the seed in progress.

**GPU time: an estimate, not measured** (the script has not run on a GPU yet): imports, model build, warm start
(300 steps on ~3.6k-token sequences) and the start-up checks about 1 minute; a step (sampling 64 first messages
token by token, playing the new ones through the environment, the old, reference and trained log-probabilities of
each distinct episode, M on the fp32 copy) ~3-6 s; the warmed condition is 10 + 5 x 6 = 40 steps a seed, so roughly
2-4 minutes a seed and 9-17 minutes for the four seeds; ``--fresh`` adds 24 steps a seed. Where one command's window
is shorter, run the seeds in parts into the same ``--out`` (``--seeds 6001 6002``, then ``--seeds 6003 6004``): a
part keeps the seeds its file already holds when design, device and warm start (its loss, the candidates'
probabilities and M, to the last bit) are the same, and the verdict is over every seed in the file.

``--smoke`` runs the same code on CPU (gloo) with a 2-layer model (``SMOKE``), the prompt cut to its last 64 tokens
(``apatch_exact.shortened``), a few warm-start steps, batches of 2 groups of 8, a 1-step trunk and 2 steps an arm,
on ``SMOKE_SEEDS`` (not the registered ones): that it starts and runs through before a GPU is lent. Its 1-2 seeds
cannot pass a t test, so its exit status follows only the negative control and the start check
(``tests/e2e/test_apatch_exact.py`` runs it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

#: Qwen2.5-0.5B-Instruct's architecture (its config.json), the vocabulary left to the tokenizer.
QWEN25_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
#: ``--smoke``: the same architecture, small enough for a CPU in seconds.
SMOKE = {**QWEN25_05B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
#: The GPU run's registered seeds: fresh, used by no other run (CPU pilot 3001-3005, CPU registered run 4000s).
GPU_SEEDS = (6001, 6002, 6003, 6004)
#: ``--smoke``'s seeds: outside the registered ones, so that no registered seed is spent on the smoke.
SMOKE_SEEDS = (6901, 6902)
#: The GPU run's arms in the warmed condition (``apatch_sampled.ARMS`` less ``on_mean1``, to fit a short window).
WARMED_ARMS = ("on", "neutral", "swapped", "off", "ones")
WARM_STEPS, WARM_LR = 300, 1e-4
#: ``--smoke``'s reductions: the batch shape (groups, group size), the trunk's and each arm's steps; its warm start's
#: steps and learning rate, enough for the 2-layer model to sample the candidates (~0.2 each) and not only others.
SMOKE_BATCH, SMOKE_TRUNK, SMOKE_ARM = (2, 8), 1, 2
SMOKE_WARM_STEPS, SMOKE_WARM_LR = 120, 3e-3


def enforce_determinism() -> None:
    """Deterministic kernels or an error: set before torch first touches CUDA (cuBLAS reads its workspace config
    when its handle is made)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ["VERL_DISABLE_FLASH_ATTN_CE"] = "1"  # verl's log-probs without flash-attn's nondeterministic kernel
    import torch

    if torch.cuda.is_initialized():
        raise SystemExit("CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was set: determinism is not enforced")
    torch.use_deterministic_algorithms(True)  # no warn_only: an op without a deterministic kernel raises
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision("highest")  # fp32 matmuls in fp32 (no TF32): M is read from an fp32 model
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def build_model(shape: dict, tokenizer, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    vocab = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(**shape, vocab_size=vocab, bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def init_distributed(device: str):
    """A one-process group and mesh, as verl's engine has one per data-parallel group."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def shard(model, mesh):
    """verl's FSDP2 wrapping (``apply_fsdp2``, per decoder layer and the root) with its engine's mixed precision."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from verl.utils.fsdp_utils import apply_fsdp2

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    apply_fsdp2(
        model, {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": None, "reshard_after_forward": True}, {}
    )
    return model


def full_weights(model) -> dict:
    """The sharded model's whole fp32 master weights: each DTensor gathered (``full_tensor``), detached."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if value.is_floating_point() and value.dtype != torch.float32:
            raise SystemExit(f"{key} is {value.dtype}, not the fp32 master weight M must be read from")
        out[key] = value.detach()
    return out


class Fp32Metric:
    """``measure(model, named)`` for ``apatch_sampled.run_seed``: M of the sharded model's fp32 master weights,
    loaded into one plain fp32 model (``copy_model``: the same config, no FSDP, no autocast), under no_grad."""

    def __init__(self, copy_model):
        self.copy = copy_model.eval().requires_grad_(False)

    def load(self, model):
        import torch

        with torch.no_grad():
            self.copy.load_state_dict(full_weights(model), strict=True)
        return self.copy

    def __call__(self, model, named) -> float:
        import apatch_exact as ax
        import torch

        copy_model = self.load(model)
        with torch.no_grad():
            return ax.heavy_minus_light(ax.candidate_logprobs(copy_model, named), named)


def state_equal(a: dict, b: dict) -> bool:
    """Two state dicts (tensors or DTensors, nested dicts and lists) equal to the last bit."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if isinstance(a, DTensor) != isinstance(b, DTensor):
            return False
        if isinstance(a, DTensor):
            a, b = a.to_local(), b.to_local()
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def check_round_trip(model, fresh, named) -> None:
    """What ``apatch_sampled.run_sampled_arm`` relies on, on the FSDP2 module: ``model.load_state_dict`` of a DTensor
    state dict (``Start.weights``) sets the weights, and AdamW's state dict survives ``copy.deepcopy`` and
    ``load_state_dict`` into a new optimizer bit for bit, its moments DTensors placed as their parameters. One
    AdamW step on the light decoy's log-probability makes a state to compare; the weights are compared in the state
    dict and through the forward (M of the bf16 forward, which must follow what was loaded); the model is left at
    ``fresh``."""
    import apatch_exact as ax
    import apatch_sampled as sx
    import torch
    from torch.distributed.tensor import DTensor

    def storage(t) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()

    def forward_m() -> float:
        with torch.no_grad():
            return ax.heavy_minus_light(ax.candidate_logprobs(model, named), named)

    actor, _ = ax.released_actor()
    m_fresh = forward_m()
    opt = ax.make_optimizer("adamw", model.parameters(), actor, sx.LIVE_LR)
    opt.zero_grad()
    (-ax.candidate_logprobs(model, {"light": named["light"]})["light"].sum()).backward()
    opt.step()
    opt.zero_grad()
    end = ax.Start({k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict())
    m_end = forward_m()
    failures = []
    if state_equal(end.weights, fresh.weights) or m_end == m_fresh:
        failures.append("an AdamW step left the weights or the forward unchanged")
    model.load_state_dict(fresh.weights)
    if not state_equal(model.state_dict(), fresh.weights) or forward_m() != m_fresh:
        failures.append("load_state_dict(fresh) did not restore the warm start")
    model.load_state_dict(end.weights)
    if not state_equal(model.state_dict(), end.weights) or forward_m() != m_end:
        failures.append("load_state_dict(end) did not restore the stepped weights")
    again = ax.make_optimizer("adamw", model.parameters(), actor, sx.LIVE_LR)
    again.load_state_dict(copy.deepcopy(end.optimizer))
    if not state_equal(again.state_dict()["state"], end.optimizer["state"]):
        failures.append("AdamW's state did not round-trip")
    for index, p in enumerate(model.parameters()):
        moment = again.state[p]["exp_avg"]
        if isinstance(p, DTensor) and not (
            isinstance(moment, DTensor) and moment.placements == p.placements and moment.device == p.device
        ):
            failures.append("a reloaded AdamW moment is not placed as its parameter")
            break
        if storage(moment) == storage(end.optimizer["state"][index]["exp_avg"]):
            failures.append("the reloaded AdamW state shares storage with the saved one")
            break
    model.load_state_dict(fresh.weights)
    model.zero_grad(set_to_none=True)
    if failures or not state_equal(model.state_dict(), fresh.weights) or forward_m() != m_fresh:
        raise SystemExit(f"the FSDP2 state round trip failed: {failures or ['the warm start not restored']}")
    print("FSDP2 state round trip (weights load_state_dict, AdamW state deepcopy + load_state_dict): bit-exact")


def starts_exact(result: dict) -> bool:
    """Every arm's M before its first step equals its condition's start: the warmed condition's the trunk's last,
    the fresh condition's the warm start's (the trunk's first): that each arm loaded where it begins."""
    trunk = result.get("trunk")
    begins = {"warmed": trunk["metric"][-1], "fresh": trunk["metric"][0]} if trunk else {}
    for condition, runs in result["conditions"].items():
        firsts = {run["metric"][0] for run in runs.values()}
        if condition in begins:
            firsts.add(begins[condition])
        if len(firsts) != 1:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="exit status: 0 when the registered rule passes and every arm starts where its condition does "
        "(--smoke: when the negative control is exact and the arms start right, its seeds being too few for the t "
        "test); 1 otherwise",
    )
    parser.add_argument("--out", required=True, help="where apatch_exact_gpu.json goes")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, a 2-layer model, the prompt cut, small batches: that it runs (exit status: the negative control)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default GPU_SEEDS (--smoke: SMOKE_SEEDS)")
    parser.add_argument("--fresh", action="store_true", help="add the fresh condition (apatch_sampled.FRESH_ARMS)")
    parser.add_argument("--trunk-updates", type=int, default=None, help="default apatch_sampled.TRUNK_UPDATES")
    parser.add_argument("--arm-updates", type=int, default=None, help="default apatch_sampled.ARM_UPDATES")
    parser.add_argument("--warm-steps", type=int, default=None, help=f"warm-start steps (default {WARM_STEPS})")
    parser.add_argument("--warm-lr", type=float, default=None, help=f"warm-start AdamW lr (default {WARM_LR})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    enforce_determinism()  # before anything imports torch's CUDA side
    if args.smoke:
        os.environ.setdefault("VERL_PLATFORM", "cpu")  # verl's device helpers on CPU (seal/cpu/platform.py)
    import apatch_exact as ax
    import apatch_sampled as sx
    import torch

    from seal.cpu.tiny_model import build_tokenizer
    from seal.cpu.warm_start import fit_examples

    device = "cpu" if args.smoke else "cuda"
    if args.smoke and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the 2-layer model's ops are too small to share; threads on a busy CPU only wait
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or --smoke on CPU")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "apatch_exact_gpu.json"
    seeds = list(args.seeds or (SMOKE_SEEDS if args.smoke else GPU_SEEDS))
    trunk_updates = args.trunk_updates or (SMOKE_TRUNK if args.smoke else sx.TRUNK_UPDATES)
    arm_updates = args.arm_updates or (SMOKE_ARM if args.smoke else sx.ARM_UPDATES)
    warm_steps = args.warm_steps if args.warm_steps is not None else (SMOKE_WARM_STEPS if args.smoke else WARM_STEPS)
    warm_lr = args.warm_lr or (SMOKE_WARM_LR if args.smoke else WARM_LR)
    batch = SMOKE_BATCH if args.smoke else ax.batch_shape()
    conditions = {"warmed": WARMED_ARMS} | ({"fresh": sx.FRESH_ARMS} if args.fresh else {})
    shape = SMOKE if args.smoke else QWEN25_05B
    lr = ax.lr_analogue(shape["hidden_size"], float(ax.released_actor()[0].optim.lr))
    design = {
        "lr": lr, "trunk_updates": trunk_updates, "arm_updates": arm_updates, "batch_shape": list(batch),
        "conditions": {c: list(arms) for c, arms in conditions.items()}, "shape": shape, "warm_steps": warm_steps,
        "warm_lr": warm_lr, "smoke": args.smoke,
    }  # fmt: skip
    default_design = not args.smoke and (trunk_updates, arm_updates) == (sx.TRUNK_UPDATES, sx.ARM_UPDATES)
    print(f"seeds {seeds}; design {design}", flush=True)

    tokenizer = build_tokenizer("bfcl_bpe")
    model = build_model(shape, tokenizer, seed=0).to(device)
    candidates = ax.load_candidates(tokenizer, "qwen2")
    if args.smoke:
        candidates = ax.shortened(candidates, prompt_tokens=64)
    named = {name: candidates[name] for name in ax.NAMES}
    prompt = named["right"].ids[: named["right"].prompt_len]
    # the sampler once on the device, before the warm start: an op that deterministic mode refuses fails in seconds
    sx.sample_messages(model, prompt[-16:], sx.step_uniforms(0, 0, 2, 2), tokenizer.eos_token_id)
    # bf16 autocast without its weight cache: the cache keeps each weight's bf16 copy until the outermost autocast
    # context exits, so every step of a loop inside one context would run the first step's weights
    with torch.device(device), torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
        warm_loss = fit_examples(model, [[(c.ids, c.mask) for c in named.values()]], warm_steps, warm_lr)
    model.eval()
    warm = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the KL loss's reference: the warm start, frozen and unsharded, with bf16 parameters as the reference worker's
    # FSDP mixed precision computes it; M's fp32 copy: the same config, fp32, no FSDP
    reference = copy.deepcopy(model).to(torch.bfloat16).eval().requires_grad_(False)
    measure = Fp32Metric(copy.deepcopy(model))
    model = shard(model, init_distributed(device))
    fresh = ax.Start({k: v.detach().clone() for k, v in model.state_dict().items()})
    if not state_equal(full_weights(model), warm):
        raise SystemExit("the sharded model's gathered weights are not the warm start's")
    del warm
    check_round_trip(model, fresh, named)
    probabilities = ax.candidate_probabilities(measure.load(model), named)
    with torch.no_grad():
        m_bf16 = ax.heavy_minus_light(ax.candidate_logprobs(model, named), named)
    m_fp32 = measure(model, named)
    ratio = max(probabilities.values()) / min(probabilities.values())
    print(
        f"candidates after {warm_steps} warm-start steps (loss {warm_loss:.4f}): {probabilities}; max/min "
        f"{ratio:.2f}; the three hold {sum(probabilities.values()):.3f} of the probability (the rest: other first "
        f"messages); M {m_fp32:+.6f} (fp32 copy), {m_bf16:+.6f} (the FSDP2 bf16 forward)",
        flush=True,
    )
    pool = sx.EpisodePool(candidates, tokenizer, "qwen2")
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__},
        "design": design,
        "warm_loss": warm_loss,
        "probabilities": probabilities,
        "m_start": {"fp32": m_fp32, "bf16_forward": m_bf16},
    }
    # an earlier part of this run (the same design, device and warm start, to the last bit) keeps its seeds
    saved = load_json(path)
    same_run = all(saved.get(k) == v for k, v in summary.items() if k != "versions")
    if saved and not same_run:
        print(f"{path} holds another design's, device's or warm start's seeds: they are not kept")
    results: dict[str, dict] = saved["seeds"] if saved and same_run else {}
    summary["seeds"] = results

    def save() -> None:  # whole or not at all: a run killed while writing leaves the last complete file
        summary["wall_s"] = time.perf_counter() - start
        part = path.with_suffix(".json.part")
        part.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(part, path)

    save()  # the start-up's record, before any seed
    for seed in seeds:
        if str(seed) in results:
            print(f"seed {seed}: kept from {path}")
        else:
            began = time.perf_counter()
            result = sx.run_seed(
                model, reference, fresh, pool, seed, trunk_updates, arm_updates, conditions=conditions,
                shape=batch, measure=measure, lr=lr,
            )  # fmt: skip
            results[str(seed)] = result | {"wall_s": time.perf_counter() - began}
            save()
        result = results[str(seed)]
        print("\n".join(sx.seed_lines(seed, result)))
        print(
            f"seed {seed}: negative control (ones == off, every step) {sx.negative_control({seed: result})}; "
            f"every arm starts at its condition's start {starts_exact(result)}",
            flush=True,
        )
    ran = {int(seed): results[seed] for seed in sorted(results, key=int)}  # this run's seeds and its earlier parts'
    registered = default_design and tuple(ran) == GPU_SEEDS
    verdict = sx.verdict(ran)
    starts = all(starts_exact(r) for r in ran.values())
    finite = all(math.isfinite(m) for r in ran.values() for run in arm_runs(r) for m in run["metric"])
    summary |= {"registered": registered, "verdict": verdict, "starts_exact": starts, "finite": finite}
    save()
    print("\n".join(sx.verdict_lines(verdict)))
    print(f"every arm starts at its condition's start: {starts}; every M finite: {finite}")
    if args.smoke:
        ok = verdict["negative_control"] and starts
        print(f"--smoke: the exit status follows the negative control and the start check only: {ok}")
    else:
        ok = verdict["passed"] and starts
        if not registered:
            print(f"seeds {list(ran)}: not the registered GPU run (GPU_SEEDS {list(GPU_SEEDS)}, the default updates)")
    print(f"wall {summary['wall_s']:.0f} s; {path}")
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


def load_json(path: Path) -> dict:
    """An earlier part's summary, or nothing (none there, or not readable)."""
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError) as error:
        print(f"{path} is not readable ({error}): not kept")
        return {}


def arm_runs(result: dict) -> list[dict]:
    """A seed's trunk and every condition's arms."""
    return [
        *([result["trunk"]] if "trunk" in result else []),
        *(r for c in result["conditions"].values() for r in c.values()),
    ]


if __name__ == "__main__":
    sys.exit(main())
