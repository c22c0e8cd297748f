#!/usr/bin/env python
"""Stage A of the A-Patch exact check (docs/learning-check.md) on the released recipe's backbone class, for a lent GPU.

    python scripts/apatch_exact_gpu.py --out experiments/apatch_exact_gpu     # one GPU, a few minutes (see below)
    python scripts/apatch_exact_gpu.py --smoke --out /tmp/apatch_exact_smoke  # CPU, reduced: that it starts and runs

The same measurement as ``scripts/learning_check.py --apatch-exact`` (``scripts/apatch_exact.py``: the candidates'
episodes from the environment's episode code, verl's GRPO, ``SealTrainer._seal_step``, verl's actor loss, the
released optimizer), on a model of the Qwen2.5 architecture as verl's FSDP2 engine trains it:

1. a Qwen2.5-0.5B-shaped model (``QWEN25_05B``: 24 layers, hidden 896), randomly initialised, with the tiny CPU
   model's small BFCL vocabulary (the machine reaches no hub, so nothing is downloaded);
2. a warm start on the three candidates' episodes (``seal.cpu.warm_start.fit_examples``, the CPU warm start's loop),
   which leaves them at comparable probabilities (printed: the check means most when they are within a factor of 2);
3. FSDP2 as verl's engine applies it (``verl.utils.fsdp_utils.apply_fsdp2``, fp32 master weights, bf16 parameters
   in the forward, fp32 gradient reduction; deterministic algorithms, so the negative control can be exact);
4. per seed, per condition (AdamW at the released learning rate's width analogue and at 1e-6, plain SGD), the arms
   ``on``, ``off``, ``swapped`` and the negative control ``ones``, ``--updates`` updates each, the metric after each.

Everything is printed and written to ``<out>/apatch_exact_gpu.json``. Not yet run on a GPU: its timing is estimated,
not measured (the 0.5B model's update on 3 sequences of ~3.6k tokens is well under a second on an H100-class GPU;
the warm start's steps dominate). ``--smoke`` runs the same code on CPU with a 2-layer model, the prompt cut to its
last 64 tokens and a few warm-start steps (``tests/e2e/test_apatch_exact.py`` runs it).
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where apatch_exact_gpu.json goes")
    parser.add_argument("--smoke", action="store_true", help="CPU, a 2-layer model, the prompt cut: that it runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="batch seeds (default: the pilot's)")
    parser.add_argument("--updates", type=int, default=None, help="updates per arm (default 3; --smoke 1)")
    parser.add_argument("--warm-steps", type=int, default=None, help="warm-start steps (default 300; --smoke 4)")
    parser.add_argument("--warm-lr", type=float, default=1e-4, help="warm-start AdamW learning rate")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("VERL_PLATFORM", "cpu")  # verl's device helpers on CPU (seal/cpu/platform.py)
    import apatch_exact as ax
    import torch

    from seal.cpu.tiny_model import build_tokenizer
    from seal.cpu.warm_start import fit_examples

    start = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or --smoke on CPU")
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("VERL_DISABLE_FLASH_ATTN_CE", "1")  # verl's log-probs without the nondeterministic kernel
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = args.seeds or (ax.PILOT_SEEDS[:1] if args.smoke else ax.PILOT_SEEDS)
    updates = args.updates or (1 if args.smoke else ax.UPDATES)
    warm_steps = args.warm_steps if args.warm_steps is not None else (4 if args.smoke else 300)

    tokenizer = build_tokenizer("bfcl_bpe")
    shape = SMOKE if args.smoke else QWEN25_05B
    model = build_model(shape, tokenizer, seed=0).to(device)
    candidates = ax.load_candidates(tokenizer, "qwen2")
    if args.smoke:
        candidates = ax.shortened(candidates, prompt_tokens=64)
    with torch.device(device), torch.autocast(device, dtype=torch.bfloat16):
        warm_loss = fit_examples(model, [[(c.ids, c.mask) for c in candidates.values()]], warm_steps, args.warm_lr)
    model = shard(model, init_distributed(device))
    probabilities = ax.candidate_probabilities(model, candidates, shared_prefix=False)
    ratio = max(probabilities.values()) / min(probabilities.values())
    print(
        f"candidates after {warm_steps} warm-start steps (loss {warm_loss:.4f}): {probabilities}; max/min {ratio:.2f}"
    )
    # the batch is drawn from the candidates' probabilities, as on CPU; from equal ones when the warm start left them
    # further apart than a factor of 2 (a batch of one candidate has no advantage to weigh), and said so
    draw_from = probabilities if ratio <= 2 else dict.fromkeys(ax.NAMES, 1.0)
    if ratio > 2:
        print("the candidates are not within a factor of 2: the batches are drawn from equal probabilities")
    conds = ax.conditions(shape["hidden_size"])
    arms = ax.arm_overrides(candidates)
    groups, group_size = ax.batch_shape()
    begin = {"fresh": ax.Start({k: v.detach().clone() for k, v in model.state_dict().items()})}
    if any(c.warmed for c in conds.values()):
        rows = ax.draw_rows(draw_from, ax.WARMUP_SEED, groups, group_size)
        warmup = ax.run_arm(
            model,
            begin["fresh"],
            candidates,
            rows,
            group_size,
            arms["off"],
            "adamw",
            ax.SMALL_LR,
            2 if args.smoke else ax.WARMUP_UPDATES,
            keep_end=True,
            shared_prefix=False,
        )
        begin["warmed"] = warmup.end
    results = {}
    for seed in seeds:
        rows = ax.draw_rows(draw_from, seed, groups, group_size)
        seed_result = {"batch": {n: rows.count(n) for n in ax.NAMES}, "conditions": {}}
        for name, c in conds.items():
            runs = {}
            for arm in (*ax.STUDIED_ARMS, "ones"):
                r = ax.run_arm(
                    model,
                    begin["warmed" if c.warmed else "fresh"],
                    candidates,
                    rows,
                    group_size,
                    arms["off" if arm == "none" else arm],
                    c.optimizer,
                    c.lr,
                    updates,
                    shared_prefix=False,
                    zero_advantages=arm == "none",
                )
                runs[arm] = {"metric": r.metric, "scales": r.scales, "grad_norms": r.grad_norms}
            seed_result["conditions"][name] = {"optimizer": c.optimizer, "lr": c.lr, "arms": runs}
            exact = runs["ones"]["metric"] == runs["off"]["metric"]
            print(f"seed {seed} {name}: negative control (ones == off, every update): {exact}")
        results[seed] = seed_result
        print("\n".join(ax.seed_lines(seed, seed_result, updates=tuple(sorted({1, updates})))), flush=True)
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "shape": shape,
        "warm_steps": warm_steps,
        "warm_loss": warm_loss,
        "probabilities": probabilities,
        "drawn_from": draw_from,
        "seeds": results,
        "wall_s": time.perf_counter() - start,
    }
    (out / "apatch_exact_gpu.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wall {summary['wall_s']:.0f} s; {out / 'apatch_exact_gpu.json'}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
