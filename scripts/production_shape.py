"""A GPU recipe's rollout concurrency on CPU: its steps' and its validation's episodes, all at once, through the real
rollout path and the launcher's own environment service, with generation made instant.

    python scripts/production_shape.py --conf exp/SEAL.yaml [--steps 3] [--scales 1,2] [hydra overrides ...]
    python scripts/production_shape.py --conf exp/SEAL.yaml --node-cpus 48 --node-memory-gib 512   # a GPU node's

What runs is what a GPU run of the recipe runs around its generation:

* the recipe composed as the CPU rehearsal composes it (``+swap=cpu``: only what a CPU machine cannot run is
  swapped), with the recipe's shape kept (``RECIPE_SHAPE``: its tasks, batch, rollouts per task, lengths, agent-loop
  workers) and a tokenizer that stands for the backbone's: the tiny model's real Qwen tokenizer (the swap's small
  vocabulary would make every prompt longer than on GPU), or for a Llama-3.1 recipe (``exp/toolace2_8b.yaml``) the
  BFCL BPE with Llama 3.1's special tokens, rendered with the recipe's own chat template;
* the launcher's own environment service over HTTP (``seal.launch.service.environment_service``: its secret, ``--parent-pid``
  watch, supervisor, and the recipe's peak episodes as its per-client limits);
* verl's agent-loop manager (seal's, as the launcher sets it) and the recipe's agent-loop workers, running the real
  ``BfclAgentLoop``: every episode of a step or a validation at once, as verl starts them;
* the ``scripted`` rollout backend (``seal/cpu/scripted_rollout.py``) in place of vLLM: it answers at once with
  ground-truth calls and a share of wrong arguments, malformed calls, extra calls, early stops and rambles cut at the
  length limit (as vLLM cuts them), so the service does real work and the episodes get varied tags;
* the agent loop's own threads for environment calls (``seal.env_clients.ENV_CALL_THREADS``), as on a GPU node:
  every episode of a worker can wait on the service at once, whatever the machine's cores.

* the trainer side of each step that needs no model (``TrainerSide``): verl's balance over the recipe's
  data-parallel ranks, reward and GRPO advantages, then the SEAL step (failed episodes out of their groups,
  diagnosis into the capability state, A-Patch) at the recipe's batch shape;
* the recipe's failure stop (``seal.validation.max_env_failure_share`` and ``max_other_failure_share``), on.

With ``--node-cpus`` (and ``--node-memory-gib``) Ray gets a GPU node's CPU slots and the service the environment
workers the launcher would size on that node (``env_service.workers.sizing``; an allocation's CPUs, no cgroup limit).

Each scale (1 = the recipe's concurrency, 2 = twice it: twice the tasks a step, each validation task twice) runs
``--steps`` training rollouts and one full validation. Per phase it prints the episodes, the environment failures,
the 429s the clients saw (and retried), the p50/p99 latency of an environment call as the agent loop waits for it,
the environment's share of the episodes' time, the service's peak memory (service and workers), and each step's
trainer side (its time, the balance, the A-Patch scales). The model's passes (old and reference log-probs, the
update) are not run (said in the output with what they would have to process). The last line sums every phase:

    production shape: E episodes at concurrency C (peak P environment calls in flight): F failed episodes, R refused
    (429), env share S%

with C the highest concurrency run and P the most environment calls in flight at once. Exit status 1 when an
episode failed or was lost, or the failure stop stopped the run.
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
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
QWEN_TOKENIZER_MODEL = {"seal.tiny_model.shape": "default", "seal.tiny_model.out_dir": "outputs/tiny-qwen"}
#: What starts a chat message, by what ends one: how the scripted server finds the messages of a prompt.
TURN_START = {"<|im_end|>": "<|im_start|>", "<|eot_id|>": "<|start_header_id|>"}
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

    from seal.launch.recipe import compose_recipe
    from seal.report.reproduction import SWAP, swap_values

    recipe = compose_recipe(conf, overrides)
    dp_ranks = _data_parallel_ranks(recipe)
    missing = [key for key in RECIPE_SHAPE if key not in swap_values()]
    assert not missing, f"RECIPE_SHAPE names keys the swap no longer has: {missing}"
    shape = [f"{key}={_value(OmegaConf.select(recipe, key))}" for key in RECIPE_SHAPE]
    batch = int(recipe.data.train_batch_size) * scale
    tokenizer_model = _tokenizer_model(recipe.env_service.bfcl.tool_prompt_mode)
    if tokenizer_model != QWEN_TOKENIZER_MODEL:
        shape += _stand_in_prompt_room(recipe)
    config = compose_recipe(
        conf,
        [
            SWAP,
            *shape,
            *[f"{key}={value}" for key, value in tokenizer_model.items()],
            f"actor_rollout_ref.model.path={tokenizer_model['seal.tiny_model.out_dir']}",
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.rollout.val_kwargs.n={int(recipe.actor_rollout_ref.rollout.val_kwargs.n) * scale}",
            "actor_rollout_ref.rollout.name=scripted",
            # verl's standalone rollout (no trainer workers to share): one replica of one "device"
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
            f"seal.run_dir={run_dir}",
            *overrides,
        ],
    )
    script = {"tool_prompt_mode": config.env_service.bfcl.tool_prompt_mode}
    script["end_of_turn_token"] = config.seal.rollout.end_of_turn_token
    script["turn_start_token"] = TURN_START[script["end_of_turn_token"]]
    OmegaConf.update(config, "actor_rollout_ref.rollout.custom", {"scripted": script}, force_add=True)
    return config, dp_ranks


def _data_parallel_ranks(recipe) -> int:
    """The actor's data-parallel ranks on the recipe's GPUs (FSDP: every GPU, less Ulysses sequence parallelism)."""
    gpus = int(recipe.trainer.n_gpus_per_node) * int(recipe.trainer.nnodes)
    return gpus // int(recipe.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)


def _tokenizer_model(prompt_mode: str) -> dict[str, str]:
    """The tiny model whose tokenizer stands for the backbone's, by the recipe's prompt format: the real Qwen
    tokenizer, or for a Llama-3.1 recipe the reproduction's stand-in (the BFCL BPE with Llama 3.1's special tokens;
    the recipe's own chat template renders the Llama 3.1 format with it, as on GPU)."""
    from seal.report.reproduction import BACKBONE_SWAPS

    if prompt_mode not in BACKBONE_SWAPS:
        return QWEN_TOKENIZER_MODEL
    return {key: value for key, value in BACKBONE_SWAPS[prompt_mode].items() if key.startswith("seal.tiny_model.")}


#: How much longer a prompt is in the Llama-3.1 stand-in's BFCL BPE than in Llama 3.1's own 128k vocabulary: the
#: longest first prompt of exp/toolace2_8b.yaml's tasks takes 12,669 of its tokens where the recipe's 10,240 hold it.
STAND_IN_PROMPT_FACTOR = 1.5


def _stand_in_prompt_room(recipe) -> list[str]:
    """The prompt budget (and the context by as much) widened for a stand-in tokenizer with a smaller vocabulary, so
    the same first prompts fit as with the backbone's; the response budget stays the recipe's."""
    prompt = int(recipe.data.max_prompt_length)
    extra = int(prompt * STAND_IN_PROMPT_FACTOR) - prompt
    print(f"[production shape] the stand-in tokenizer's prompts are longer: data.max_prompt_length {prompt} + {extra}")
    room = [f"data.max_prompt_length={prompt + extra}"]
    if recipe.actor_rollout_ref.rollout.get("max_model_len"):
        room.append(
            f"actor_rollout_ref.rollout.max_model_len={int(recipe.actor_rollout_ref.rollout.max_model_len) + extra}"
        )
    return room


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
            "failed_episodes": failed,
            "failure_kinds": dict(Counter(k for k in output.non_tensor_batch["seal_failure_kind"] if k)),
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


@dataclass(frozen=True)
class Node:
    """The resources a GPU node shows its job (``--node-cpus``, ``--node-memory-gib``): Ray's CPU slots, and the
    environment workers the launcher would size there (``env_service.workers.sizing``). None: this machine's."""

    cpus: int
    memory_gib: float

    def env_workers(self, peak_episodes: int):
        from env_service.workers.sizing import size_workers

        with tempfile.TemporaryDirectory() as folder:  # no cgroup limits; the node's MemAvailable
            meminfo = Path(folder) / "meminfo"
            meminfo.write_text(f"MemAvailable: {int(self.memory_gib * 2**20)} kB\n")
            return size_workers(peak_episodes, cgroup_root=folder, meminfo=meminfo, affinity=set(range(self.cpus)))


def run_scale(conf: str, scale: int, steps: int, out: Path, overrides: list[str], node: Node | None) -> list[dict]:
    import ray
    from omegaconf import OmegaConf

    from seal.launch.preflight import run_checks
    from seal.launch.run_env import set_run_environment
    from seal.launch.service import environment_service, peak_episodes

    config, dp_ranks = compose(conf, scale, out / f"x{scale}", overrides)
    for warning in run_checks(config).warnings:  # as the launcher checks and prepares a run
        print(f"[production shape] warning: {warning}")
    peak = peak_episodes(config)
    workers = int(config.actor_rollout_ref.rollout.agent.num_workers)
    if node is not None:
        sizing = node.env_workers(peak)
        OmegaConf.update(config, "env_service.serve.workers", sizing.workers)
        print(f"[production shape] a node of {node.cpus} CPUs and {node.memory_gib:g} GiB: {sizing.describe()}")
    from seal.env_clients import ENV_CALL_THREADS

    print(
        f"[production shape] x{scale}: {config.data.train_batch_size} x {config.actor_rollout_ref.rollout.n} "
        f"episodes a step, validation x{config.actor_rollout_ref.rollout.val_kwargs.n}: {peak} at once at most; "
        f"{workers} agent-loop workers, up to {ENV_CALL_THREADS} environment-call threads each"
    )
    probe = out / f"probe-x{scale}"
    shutil.rmtree(probe, ignore_errors=True)  # an earlier run's
    probe.mkdir(parents=True)
    results = []
    with environment_service(config) as url:
        OmegaConf.set_struct(config, False)
        config.env_service.url = url
        set_run_environment(config)
        OmegaConf.resolve(config)  # as verl's task runner does before it builds anything
        _start_ray(config, probe, node)
        try:
            results = _rollouts(config, steps, probe, dp_ranks)
        finally:
            ray.shutdown()
    return results


def _start_ray(config, probe: Path, node: Node | None) -> None:
    """A local Ray cluster with the run's runtime env (as verl's run_ppo starts one), plus the probe in every verl
    process."""
    import ray

    from seal.launch.run_env import verl_runtime_env

    runtime_env = verl_runtime_env(config)
    env = runtime_env.setdefault("env_vars", {})
    env[PROBE_DIR] = str(probe)
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join(
        filter(None, [env.get("VERL_USE_EXTERNAL_MODULES"), "production_shape"])
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), str(REPO / "scripts"), os.environ.get("PYTHONPATH")]))
    # Ray's slots, not cores: the node's, else one per agent-loop worker and a few for verl's other actors
    ray.init(
        num_cpus=node.cpus if node else int(config.actor_rollout_ref.rollout.agent.num_workers) + 4,
        include_dashboard=False,
        runtime_env=runtime_env,
        log_to_driver=False,
    )


def _rollouts(config, steps: int, probe: Path, dp_ranks: int) -> list[dict]:
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
    from seal.failed_episodes import SealAgentLoopManager, failure_shares, raise_if_too_many
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
    trainer_side = TrainerSide(config, dp_ranks, steps_per_epoch=len(loader))
    for step in range(1, steps + 1):
        batch = DataProto.from_single_dict(next(batches))
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
        gen = RayPPOTrainer._get_gen_batch(None, batch)
        gen.meta_info["global_steps"] = step
        gen = gen.repeat(repeat_times=int(rollout.n), interleave=True)
        phase = Phase(f"step {step}", probe, client.health)
        output = manager.generate_sequences(gen)  # the failure stop: as in training (SealAgentLoopManager)
        results.append(phase.finish(output, rss.take(), len(gen)))
        _print(results[-1])
        results[-1]["trainer_side"] = trainer_side.step(step, batch, output)

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
    nt = output.non_tensor_batch  # the validation's failure stop, as the trainer's validation has it
    raise_if_too_many(nt["seal_failure_kind"], nt["seal_error"], failure_shares(config.seal.validation), "validation")
    rss.stop()
    return results


class TrainerSide:
    """What a step runs between its rollout and its model passes, none of which needs the model: verl's own pieces
    in ``fit``'s order (the batch joined with its rollout, the response mask, ``_balance_batch`` over the recipe's
    data-parallel ranks, the reward, ``compute_advantage``) and then the SEAL step (``_seal_step``: failed episodes
    out of their groups, diagnosis into the capability state, A-Patch), on a trainer with no workers behind it."""

    def __init__(self, config, dp_ranks: int, steps_per_epoch: int):
        from seal.trainer import SealTrainer

        self.config, self.dp_ranks = config, dp_ranks
        self.trainer = SealTrainer.seal_parts_only(config, steps_per_epoch)
        self.trainer._get_dp_size = lambda worker_group, role: dp_ranks  # what the actor's worker group would say
        self.trainer.actor_rollout_wg = None

    def step(self, step: int, batch, output) -> dict:
        import torch
        from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask
        from verl.trainer.ppo.reward import extract_reward

        algorithm, rollout = self.config.algorithm, self.config.actor_rollout_ref.rollout
        start = time.perf_counter()
        batch = batch.repeat(repeat_times=int(rollout.n), interleave=True).union(output)
        if "response_mask" not in batch.batch.keys():  # as fit: the agent loop's mask (a failed episode's is empty)
            batch.batch["response_mask"] = compute_response_mask(batch)
        metrics: dict = {}
        if self.config.trainer.balance_batch:
            self.trainer._balance_batch(batch, metrics=metrics)
        rewards, _ = extract_reward(batch)
        batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = rewards
        batch = compute_advantage(
            batch,
            adv_estimator=algorithm.adv_estimator,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            num_repeat=int(rollout.n),
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
            config=algorithm,
        )
        self.trainer.global_steps = step
        metrics.update(self.trainer._seal_step(batch))
        advantages = batch.batch["advantages"][batch.batch["response_mask"].bool()]
        metrics["trainer_side_s"] = time.perf_counter() - start
        metrics["trained_tokens"] = int(batch.batch["response_mask"].sum())
        metrics["nonzero_advantage_share"] = float((advantages != 0).float().mean()) if len(advantages) else 0.0
        if not torch.isfinite(batch.batch["advantages"]).all():
            raise RuntimeError(f"step {step}: a non-finite advantage after the SEAL step")
        self._print(step, metrics)
        return metrics

    def _print(self, step: int, m: dict) -> None:
        from seal.diagnostics import METRIC_STATE

        balance = m.get("global_seqlen/max", 0) / max(m.get("global_seqlen/min", 0), 1)
        scales = "/".join(f"{m.get(f'{self.trainer.apatch_cfg.metric_prefix}/scale/{q}', 1.0):.2f}" for q in QUANTILES)
        print(
            f"[production shape] step {step} trainer side: {m['trainer_side_s']:.2f} s (balance, reward, GRPO, SEAL "
            f"step); {m['trained_tokens']:,} trained tokens over {self.dp_ranks} data-parallel ranks, max/min tokens "
            f"a rank {balance:.3f}; non-zero advantages on {100 * m['nonzero_advantage_share']:.0f}% of trained "
            f"tokens; A-Patch scale min/p50/max {scales}; capability state observed "
            f"{m.get(f'{METRIC_STATE}/observe_count', 0):.0f} trajectories",
            flush=True,
        )


#: The A-Patch scale quantiles a step's line prints.
QUANTILES = ("min", "p50", "max")


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
        f"[production shape] {r['phase']}: {r['episodes']} episodes at once, {r['failed_episodes']} failed episodes {r['failure_kinds']}, "
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
        f"production shape: {episodes} episodes at concurrency {max(r['concurrency'] for r in results)} (peak "
        f"{max(r['peak_in_flight'] for r in results)} environment calls in flight): "
        f"{sum(r['failed_episodes'] for r in results)} failed episodes, {sum(r['refused_429'] for r in results)} refused "
        f"(429), env share {100 * share:.0f}%"
    )


def main(argv: list[str] | None = None) -> int:
    from seal.failed_episodes import TooManyFailedEpisodes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", default="exp/SEAL.yaml", help="the GPU recipe (default exp/SEAL.yaml)")
    parser.add_argument("--steps", type=int, default=3, help="training rollouts per scale (default 3)")
    parser.add_argument("--scales", default="1,2", help="concurrency scales: 1 = the recipe's (default 1,2)")
    parser.add_argument("--out", default="experiments/production_shape", help="run folder (service log, probes)")
    parser.add_argument("--node-cpus", type=int, help="a GPU node's CPUs (Ray's slots, the env workers sized there)")
    parser.add_argument("--node-memory-gib", type=float, default=1024.0, help="with --node-cpus: its memory")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. env_service.serve.workers=4")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out).resolve()
    node = Node(args.node_cpus, args.node_memory_gib) if args.node_cpus else None
    results = []
    try:
        for scale in [int(s) for s in args.scales.split(",")]:
            results += run_scale(args.conf, scale, args.steps, out, args.overrides, node)
    except TooManyFailedEpisodes as stop:  # the recipe's own failure stop
        print(f"[production shape] stopped: {stop}", flush=True)
        return 1
    tokens = max(r["tokens"] for r in results if r["phase"].startswith("step"))
    mean = max(r["mean_tokens"] for r in results if r["phase"].startswith("step"))
    print(
        f"[production shape] update: skipped. The tiny model's old-log-prob, reference and update passes would "
        f"take the largest step's {tokens:,} tokens ({mean:,.0f} per sequence): far beyond 2 cores in a benchmark; "
        "this measures the rollout path and the environment service."
    )
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = sum(r["failed_episodes"] + r["lost"] for r in results)
    print(summary(results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
