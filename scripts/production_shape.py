"""A GPU recipe's rollout concurrency on CPU: its steps' and its validation's episodes, all at once, through the real
rollout path and the launcher's own environment service, with generation made instant.

    python scripts/production_shape.py --conf exp/SEAL.yaml [--steps 3] [--scales 1,2] [hydra overrides ...]

What runs is what a GPU run of the recipe runs around its generation:

* the recipe composed as the CPU rehearsal composes it (``+swap=cpu``: only what a CPU machine cannot run is
  swapped), with the recipe's shape kept (``RECIPE_SHAPE``: its tasks, batch, rollouts per task, lengths, agent-loop
  workers) and the tiny model's real Qwen tokenizer (the swap's small vocabulary would make every prompt longer than
  on GPU);
* the launcher's own environment service over HTTP (``seal.launch.environment_service``: its secret, ``--parent-pid``
  watch, supervisor, and the recipe's peak episodes as its per-client limits);
* verl's agent-loop manager (seal's, as the launcher sets it) and the recipe's agent-loop workers, running the real
  ``BfclAgentLoop``: every episode of a step or a validation at once, as verl starts them;
* the ``scripted`` rollout backend (``seal/cpu/scripted_rollout.py``) in place of vLLM: it answers at once with
  ground-truth calls and a share of wrong arguments, malformed calls, extra calls and early stops, so the service
  does real work and the episodes get varied tags;
* the agent loop's own threads for environment calls (``seal.agent_loop.ENV_CALL_THREADS``), as on a GPU node:
  every episode of a worker can wait on the service at once, whatever the machine's cores.

Each scale (1 = the recipe's concurrency, 2 = twice it: twice the tasks a step, each validation task twice) runs
``--steps`` training rollouts and one full validation. Per phase it prints the episodes, the environment failures,
the 429s the clients saw (and retried), the p50/p99 latency of an environment call as the agent loop waits for it,
the environment's share of the episodes' time, and the service's peak memory (service and workers). The model's
update is not run (said in the output with what it would have to process): this measures the rollout path. The last
line sums every phase:

    production shape: E episodes at concurrency C: F env failures, R refused (429), env share S%

with C the highest concurrency run. Exit status 1 when an episode failed or was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: The swap's keys that set a run's shape rather than its hardware: kept at the recipe's values.
RECIPE_SHAPE = (
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.agent.num_workers",
    "seal.rollout.max_model_calls",
    "seal.rollout.max_env_tokens",
)
#: The tiny model with the real Qwen tokenizer (built offline): the recipe's token counts, with no model to run.
TOKENIZER_MODEL = ("seal.tiny_model.shape=default", "seal.tiny_model.out_dir=outputs/tiny-qwen")
#: Where the agent-loop workers' clients write what they measured (one file per process).
PROBE_DIR = "SEAL_PRODUCTION_SHAPE_PROBE"


# ---- in the agent-loop workers: what each environment call cost ------------------------------------------------


def install_probe(folder: str) -> None:
    """Time every environment call of this process's clients and count the retries they log (loaded into every
    verl process through ``VERL_USE_EXTERNAL_MODULES``; nothing of the calls changes)."""
    from env_service.client import EnvClient

    out = open(Path(folder) / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the process
    lock = threading.Lock()
    call = EnvClient._call

    def timed(self, endpoint, payload):
        start = time.time()
        result, ok = None, False
        try:
            result = call(self, endpoint, payload)
            ok = True
            return result
        finally:
            answered = result.get("instance_id") if isinstance(result, dict) else None
            instance = payload.get("instance_id") or answered
            line = {"endpoint": endpoint, "start": start, "end": time.time(), "ok": ok, "instance": instance}
            with lock:
                out.write(json.dumps(line) + "\n")

    class Retries(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "retrying" in message:
                with lock:
                    out.write(json.dumps({"retry": message.split(";")[0], "at": time.time()}) + "\n")

    EnvClient._call = timed
    logging.getLogger("env_service.client").addHandler(Retries())


if os.environ.get(PROBE_DIR) and __name__ != "__main__":
    install_probe(os.environ[PROBE_DIR])


# ---- the run ---------------------------------------------------------------------------------------------------


def compose(conf: str, scale: int, run_dir: Path, overrides: list[str]):
    from omegaconf import OmegaConf

    from seal.launch import compose_recipe
    from seal.report.reproduction import SWAP, swap_values

    recipe = compose_recipe(conf, overrides)
    missing = [key for key in RECIPE_SHAPE if key not in swap_values()]
    assert not missing, f"RECIPE_SHAPE names keys the swap no longer has: {missing}"
    shape = [f"{key}={_value(OmegaConf.select(recipe, key))}" for key in RECIPE_SHAPE]
    batch = int(recipe.data.train_batch_size) * scale
    config = compose_recipe(
        conf,
        [
            SWAP,
            *shape,
            *TOKENIZER_MODEL,
            "actor_rollout_ref.model.path=outputs/tiny-qwen",
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.rollout.val_kwargs.n={int(recipe.actor_rollout_ref.rollout.val_kwargs.n) * scale}",
            "actor_rollout_ref.rollout.name=scripted",
            # verl's standalone rollout (no trainer workers to share): one replica of one "device"
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "seal.validation.max_env_failure_share=1.0",  # every failure counted here, not stopped at
            "seal.validation.max_other_failure_share=1.0",
            f"seal.run_dir={run_dir}",
            *overrides,
        ],
    )
    script = {"tool_prompt_mode": config.env_service.bfcl.tool_prompt_mode}
    script["end_of_turn_token"] = config.seal.rollout.end_of_turn_token
    OmegaConf.update(config, "actor_rollout_ref.rollout.custom", {"scripted": script}, force_add=True)
    return config


def _value(value) -> str:
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return json.dumps(value) if isinstance(value, (list, dict)) else "null" if value is None else str(value)


class Phase:
    """What one rollout (a step's or a validation's) cost: read from the probe files and the service."""

    def __init__(self, name: str, probe: Path, health):
        self.name, self.probe, self.health = name, probe, health
        self.lines_before = _probe_lines(probe)
        self.before = health()
        self.start = time.time()

    def finish(self, output, peak_rss: int, concurrency: int) -> dict:
        wall = time.time() - self.start
        after = self.health()
        lines = _new_lines(self.probe, self.lines_before)
        calls = [line for line in lines if "endpoint" in line]
        retries = Counter(line["retry"] for line in lines if "retry" in line)
        refused = sum(n for reason, n in retries.items() if "HTTP 429" in reason)
        latencies = sorted(line["end"] - line["start"] for line in calls)
        edges = sorted([(line["start"], 1) for line in calls] + [(line["end"], -1) for line in calls])
        in_flight = max(itertools.accumulate(step for _, step in edges), default=0)
        episodes = _episodes(calls)
        waited = sum(e["env_s"] for e in episodes.values())
        lived = sum(e["end"] - e["start"] for e in episodes.values())
        failed = int(sum(bool(f) for f in output.non_tensor_batch["seal_failed"]))
        tokens = output.batch["attention_mask"].sum(-1)
        return {
            "phase": self.name,
            "episodes": len(output),
            "concurrency": concurrency,
            "env_failures": failed,
            "lost": int(after.get("episodes_lost", 0) - self.before.get("episodes_lost", 0)),
            "refused_429": refused,
            "other_retries": sum(retries.values()) - refused,
            "env_calls": len(calls),
            "peak_in_flight": in_flight,
            "p50_ms": _quantile(latencies, 0.50) * 1000,
            "p99_ms": _quantile(latencies, 0.99) * 1000,
            "env_share": waited / lived if lived else 0.0,
            "env_wait_s": waited,
            "episode_s": lived,
            "wall_s": wall,
            "service_peak_rss_mib": peak_rss / 2**20,
            "tokens": int(tokens.sum()),
            "mean_tokens": float(tokens.float().mean()),
            "reward_mean": float(output.batch["rm_scores"].sum(-1).mean()) if "rm_scores" in output.batch else 0.0,
            "tags": dict(Counter(t for tags in output.non_tensor_batch["seal_tags"] for t in tags).most_common(4)),
        }


def _probe_lines(folder: Path) -> dict[str, int]:
    return {str(path): sum(1 for _ in open(path)) for path in folder.glob("*.jsonl")}


def _new_lines(folder: Path, before: dict[str, int]) -> list[dict]:
    lines = []
    for path in folder.glob("*.jsonl"):
        with open(path) as f:
            for number, line in enumerate(f):
                if number >= before.get(str(path), 0) and line.endswith("\n"):
                    lines.append(json.loads(line))
    return lines


def _episodes(calls: list[dict]) -> dict[str, dict]:
    """Per episode (instance id): from its create's start to its last call's end, and its time in env calls."""
    episodes: dict[str, dict] = {}
    for call in calls:
        if not call.get("instance"):
            continue
        e = episodes.setdefault(call["instance"], {"start": call["start"], "end": call["end"], "env_s": 0.0})
        e["start"], e["end"] = min(e["start"], call["start"]), max(e["end"], call["end"])
        e["env_s"] += call["end"] - call["start"]
    return episodes


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class PeakRss:
    """The service's peak resident memory (its process and its workers), sampled twice a second."""

    def __init__(self, pid: int):
        import psutil

        self.process, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        import psutil

        while not self._stop.wait(0.5):
            with contextlib.suppress(psutil.Error):
                tree = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in tree))

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return peak

    def stop(self):
        self._stop.set()


def run_scale(conf: str, scale: int, steps: int, out: Path, overrides: list[str]) -> list[dict]:
    import ray
    from omegaconf import OmegaConf

    from seal import launch
    from seal.launch.env_services import peak_episodes

    config = compose(conf, scale, out / f"x{scale}", overrides)
    launch.check_values(config)
    launch.check_inputs(config)
    config = launch.prepare(config)
    for warning in launch.preflight(config):
        print(f"[production shape] warning: {warning}")
    peak = peak_episodes(config)
    workers = int(config.actor_rollout_ref.rollout.agent.num_workers)
    from seal.agent_loop import ENV_CALL_THREADS

    print(
        f"[production shape] x{scale}: {config.data.train_batch_size} x {config.actor_rollout_ref.rollout.n} "
        f"episodes a step, validation x{config.actor_rollout_ref.rollout.val_kwargs.n}: {peak} at once at most; "
        f"{workers} agent-loop workers, up to {ENV_CALL_THREADS} environment-call threads each"
    )
    probe = out / f"probe-x{scale}"
    shutil.rmtree(probe, ignore_errors=True)  # an earlier run's
    probe.mkdir(parents=True)
    results = []
    with launch.environment_service(config) as url:
        OmegaConf.set_struct(config, False)
        config.env_service.url = url
        launch.set_run_environment(config)
        OmegaConf.resolve(config)  # as verl's task runner does before it builds anything
        _start_ray(config, probe)
        try:
            results = _rollouts(config, steps, probe)
        finally:
            ray.shutdown()
    return results


def _start_ray(config, probe: Path) -> None:
    """A local Ray cluster with the run's runtime env (as verl's run_ppo starts one), plus the probe in every verl
    process."""
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    runtime_env = OmegaConf.to_container(
        OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env), resolve=True
    )
    env = runtime_env.setdefault("env_vars", {})
    env[PROBE_DIR] = str(probe)
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(
        filter(None, [env.get("VERL_USE_EXTERNAL_MODULES"), "production_shape"])
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "scripts"), os.environ.get("PYTHONPATH")]))
    # Ray's slots, not cores: one per agent-loop worker and a few for verl's other actors
    ray.init(
        num_cpus=int(config.actor_rollout_ref.rollout.agent.num_workers) + 4,
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=False,
    )


def _rollouts(config, steps: int, probe: Path) -> list[dict]:
    import numpy as np
    from torch.utils.data import DataLoader
    from verl import DataProto
    from verl.protocol import pad_dataproto_to_divisor
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.llm_server import LLMServerManager

    from env_service.client import EnvClient
    from seal.failed_episodes import SealAgentLoopManager
    from seal.resume import train_sampler

    model = omega_conf_to_dataclass(config.actor_rollout_ref.model, HFModelConfig)
    tokenizer = model.tokenizer
    llm = LLMServerManager.create(config=config, worker_group=None)
    manager = SealAgentLoopManager.create(config=config, llm_client=llm.get_client())
    client = EnvClient(config.env_service.url, timeout_s=10, retries=2)
    service_pid = _service_pid(config)
    rss = PeakRss(service_pid)
    results = []
    rollout = config.actor_rollout_ref.rollout

    train = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
    loader = DataLoader(
        train,
        batch_size=int(config.data.train_batch_size),
        sampler=train_sampler(config.data, train),
        collate_fn=collate_fn,
        drop_last=True,
    )
    batches = iter(loader)
    for step in range(1, steps + 1):
        batch = DataProto.from_single_dict(next(batches))
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        gen = RayPPOTrainer._get_gen_batch(None, batch)
        gen.meta_info["global_steps"] = step
        gen = gen.repeat(repeat_times=int(rollout.n), interleave=True)
        phase = Phase(f"step {step}", probe, client.health)
        output = manager.generate_sequences(gen)
        results.append(phase.finish(output, rss.take(), len(gen)))
        _print(results[-1])

    val = create_rl_dataset(config.data.val_files, config.data, tokenizer, None, is_train=False)
    batch = DataProto.from_single_dict(collate_fn([val[i] for i in range(len(val))]))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    batch = batch.repeat(repeat_times=int(rollout.val_kwargs.n), interleave=True)
    gen = RayPPOTrainer._get_gen_batch(None, batch)
    gen.meta_info = {
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "recompute_log_prob": False,
        "do_sample": rollout.val_kwargs.do_sample,
        "validate": True,
        "global_steps": steps,
    }
    gen, _ = pad_dataproto_to_divisor(gen, int(rollout.agent.num_workers))
    phase = Phase("validation", probe, client.health)
    output = manager.generate_sequences(gen)
    results.append(phase.finish(output, rss.take(), len(gen)))
    _print(results[-1])
    rss.stop()
    return results


def _service_pid(config) -> int:
    """The launcher's service by its identity; a service of yours (``env_service.url``) by its port."""
    import psutil

    env = config.env_service
    flag = f"--service-id {env.service_id}" if env.service_id else f"--port {env.url.rsplit(':', 1)[1]}"
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if command[1:4] == ["-m", "env_service", "serve"] and flag in " ".join(command):
            return process.pid
    raise RuntimeError("the environment service's process was not found")


def _print(r: dict) -> None:
    print(
        f"[production shape] {r['phase']}: {r['episodes']} episodes at once, {r['env_failures']} env failures, "
        f"{r['lost']} lost, {r['refused_429']} refused (429) and retried, {r['other_retries']} other retries; "
        f"{r['env_calls']} env calls ({r['peak_in_flight']} at most in flight), p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms; env share "
        f"{100 * r['env_share']:.0f}% of the episodes' time; rollout {r['wall_s']:.1f} s; service peak RSS "
        f"{r['service_peak_rss_mib']:.0f} MiB; reward {r['reward_mean']:.2f}, tags {r['tags']}",
        flush=True,
    )


def summary(results: list[dict]) -> str:
    episodes = sum(r["episodes"] for r in results)
    share = sum(r["env_wait_s"] for r in results) / max(sum(r["episode_s"] for r in results), 1e-9)
    return (
        f"production shape: {episodes} episodes at concurrency {max(r['concurrency'] for r in results)}: "
        f"{sum(r['env_failures'] for r in results)} env failures, {sum(r['refused_429'] for r in results)} refused "
        f"(429), env share {100 * share:.0f}%"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", default="exp/SEAL.yaml", help="the GPU recipe (default exp/SEAL.yaml)")
    parser.add_argument("--steps", type=int, default=3, help="training rollouts per scale (default 3)")
    parser.add_argument("--scales", default="1,2", help="concurrency scales: 1 = the recipe's (default 1,2)")
    parser.add_argument("--out", default="experiments/production_shape", help="run folder (service log, probes)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. env_service.serve.workers=4")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out).resolve()
    results = []
    for scale in [int(s) for s in args.scales.split(",")]:
        results += run_scale(args.conf, scale, args.steps, out, args.overrides)
    tokens = max(r["tokens"] for r in results if r["phase"].startswith("step"))
    mean = max(r["mean_tokens"] for r in results if r["phase"].startswith("step"))
    print(
        f"[production shape] update: skipped. The tiny model's old-log-prob, reference and update passes would "
        f"take the largest step's {tokens:,} tokens ({mean:,.0f} per sequence): far beyond 2 cores in a benchmark; "
        "this measures the rollout path and the environment service."
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = sum(r["env_failures"] + r["lost"] for r in results)
    print(summary(results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
