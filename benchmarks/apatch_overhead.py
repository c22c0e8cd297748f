"""Cost of SEAL's diagnosis-guided part of a training step, relative to verl's GRPO advantage.

Measured on one synthetic recipe-shaped batch (32 tasks × 8 rollouts = 256 trajectories, response
length 4096, 1–8 tags per trajectory): the time of
    capability-state observe (256 trajectories) → dynamic weight update → A-Patch scaling
divided by the time of ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`` on the same
batch, both measured in the same run (median of ``repeats``). Run: ``python benchmarks/apatch_overhead.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Run as a script, this directory comes first on sys.path, where benchmarks/env_service.py would shadow the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from env_service.vocabulary import CATEGORY_NAMES as CATEGORIES  # noqa: E402
from seal.apatch import APatchConfig, apply_apatch  # noqa: E402
from seal.capability_state import CapabilityState  # noqa: E402

# Rough shape of early-training tags: mostly pass, a spread of failures, rare scorer errors.
TAG_POOL = (
    ["pass"] * 10
    + ["state_mismatch"] * 4
    + ["response_mismatch"] * 3
    + ["empty_turn_model_response"] * 3
    + ["correct_abstention"] * 2
    + ["spurious_tool_call"] * 2
    + ["instance_mismatch", "checker_error"]
)
RECIPE_APATCH = {
    "enable": True,
    "min_scale": 0.5,
    "max_scale": 2.0,
    "apply_to": "all",
    "dynamic": {"enable": True, "ema_beta": 0.25, "prevalence_alpha": 1.0, "confidence_samples": 32},
}


def make_batch(batch: int = 256, response_len: int = 4096, rollouts: int = 8, seed: int = 0) -> dict[str, Any]:
    """Synthetic batch in the trainer's shapes: token rewards/mask/uids plus per-trajectory tags."""
    if batch % rollouts:
        raise ValueError(f"batch {batch} is not a multiple of rollouts {rollouts}")
    rng = random.Random(seed)
    lengths = torch.tensor([rng.randint(64, response_len) for _ in range(batch)])
    positions = torch.arange(response_len).unsqueeze(0)
    mask = (positions < lengths.unsqueeze(1)).float()
    trajectories = []
    rewards = torch.zeros(batch, response_len)
    for i in range(batch):
        task = i // rollouts
        tags = [rng.choice(TAG_POOL) for _ in range(rng.randint(1, 8))]
        reward = 1.0 if all(t in ("pass", "correct_abstention") for t in tags) else 0.0
        rewards[i, lengths[i] - 1] = reward
        category = CATEGORIES[task % len(CATEGORIES)]
        trajectories.append({"task_id": f"{category}_{task}", "category": category, "reward": reward, "tags": tags})
    index = np.array([f"uid-{i // rollouts}" for i in range(batch)], dtype=object)
    return {"rewards": rewards, "mask": mask, "index": index, "trajectories": trajectories}


def _interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds per function, alternating them every repeat so that load changes on shared
    cores hit all of them alike (a ratio of two separately timed blocks can be off by 5x)."""
    for fn in fns.values():
        fn()  # warm-up: first-call allocations, lazy imports
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(
    batch: int = 256, response_len: int = 4096, repeats: int = 50, seed: int = 0, threads: int | None = 1
) -> dict[str, Any]:
    """Median seconds for GRPO and for the SEAL part, and their ratio, from one run.

    ``threads`` sets torch's intra-op threads for the measurement (restored afterwards). Default 1:
    with 2 threads on busy shared cores both timings jump between ~2 ms and ~16 ms (scheduler waits),
    which says nothing about the code. None keeps the current setting."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    data = make_batch(batch, response_len, seed=seed)
    cfg = APatchConfig.from_dict(RECIPE_APATCH)
    tags = [t["tags"] for t in data["trajectories"]]
    state = CapabilityState(run_id="bench")
    step = [0]

    def grpo():
        return compute_grpo_outcome_advantage(data["rewards"], data["mask"], data["index"])

    advantages, _ = grpo()

    def observe():
        step[0] += 1
        for t in data["trajectories"]:
            state.observe(t["category"], t["task_id"], t["reward"], t["reward"] >= 1.0, t["tags"], 0, step[0])

    def apatch():  # dynamic weight update + scaling
        return apply_apatch(advantages, tags, cfg, global_step=step[0], state=state)

    def seal_part():
        observe()
        return apatch()

    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        used_threads = torch.get_num_threads()
        t = _interleaved_medians({"grpo": grpo, "seal": seal_part, "observe": observe, "apatch": apatch}, repeats)
    finally:
        torch.set_num_threads(previous_threads)
    return {
        "batch": batch,
        "response_len": response_len,
        "repeats": repeats,
        "torch_threads": used_threads,
        "grpo_s": t["grpo"],
        "seal_s": t["seal"],
        "observe_s": t["observe"],
        "apatch_s": t["apatch"],
        "ratio": t["seal"] / t["grpo"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON")
    args = parser.parse_args()
    r = measure(args.batch, args.response_len, args.repeats, threads=args.threads or None)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(
        f"batch {r['batch']} x response_len {r['response_len']}, median of {r['repeats']}, "
        f"{r['torch_threads']} torch threads"
    )
    print(f"  verl GRPO advantage                  {r['grpo_s'] * 1e3:9.3f} ms")
    print(f"  SEAL observe + dynamic + A-Patch     {r['seal_s'] * 1e3:9.3f} ms")
    print(f"    of which state observe             {r['observe_s'] * 1e3:9.3f} ms")
    print(f"    of which dynamic update + A-Patch  {r['apatch_s'] * 1e3:9.3f} ms")
    print(f"  ratio SEAL / GRPO                    {r['ratio']:9.3f}")


if __name__ == "__main__":
    main()
