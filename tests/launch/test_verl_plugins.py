"""seal's verl plugin: entry point, `hf` rollout registration, CPU platform, CPU overrides compose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

PROBE = r"""
import json, os
import verl
from verl.plugin.platform import PlatformRegistry
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.replica import get_rollout_replica_class
out = {
    "adapter": get_rollout_class("hf", "async").__name__,
    "replica": get_rollout_replica_class("hf").__name__,
    "platforms": list(PlatformRegistry.registered_names()),
    "engine_device_env": os.environ.get("VERL_ENGINE_DEVICE"),
}
if os.environ.get("VERL_PLATFORM") == "cpu":
    import torch
    from verl.utils import device
    import verl.utils.distributed as dist_utils
    from verl.workers.engine import EngineRegistry
    torch_device = device.get_torch_device()
    torch_device.empty_cache(); torch_device.synchronize(); torch_device.manual_seed(0)
    out.update(
        device=device.get_device_name(),
        device_id=device.get_device_id(),
        backend=device.get_nccl_backend(),
        resource=device.get_resource_name(),
        ipc=device.is_support_ipc(),
        engine=EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__,
        patched=getattr(dist_utils.initialize_global_process_group_ray, "__seal_cpu_patched__", False),
        tensor_device=str(torch.ones(1).to(device.get_device_id()).device),
        free_mem_positive=torch_device.mem_get_info()[0] > 0,
    )
print("PROBE" + json.dumps(out))
"""


def _probe(**env) -> dict:
    unset = ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES", "VERL_ENGINE_DEVICE")
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE"))
    return json.loads(line[len("PROBE") :])


def test_entry_point_is_installed():
    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("seal") == "seal.verl_plugins", "stale install: run `pip install --no-deps -e .`"


def test_hf_rollout_registered_and_cpu_platform_inert_by_default():
    out = _probe()
    assert (out["adapter"], out["replica"]) == ("HFRolloutAdapter", "HFRolloutReplica")
    # "cpu" is selectable, but nothing CPU-specific happened (GPU runs are unaffected)
    assert "cpu" in out["platforms"] and out["engine_device_env"] is None


def test_cpu_platform_is_never_auto_detected():
    from seal.cpu.platform import platform_class

    assert platform_class()().is_platform_available(use_smi_check=True) is False


def test_cpu_platform_when_requested():
    out = _probe(VERL_PLATFORM="cpu")
    assert "cpu" in out["platforms"]
    assert (out["device"], out["device_id"], out["backend"], out["resource"]) == ("cpu", "cpu", "gloo", "GPU")
    assert out["ipc"] is False and out["free_mem_positive"]
    assert out["engine"] == "FSDPEngineWithLMHead" and out["patched"]
    assert out["tensor_device"] == "cpu"


def test_cpu_runtime_env_reaches_every_worker_and_keeps_user_modules(monkeypatch):
    from seal.cpu.platform import CPU_ENV, cpu_runtime_env

    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "my.module")
    env = cpu_runtime_env({"EXTRA": "a,b"})
    assert env["VERL_PLATFORM"] == CPU_ENV["VERL_PLATFORM"] == "cpu" and env["EXTRA"] == "a,b"
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",") == ["my.module", "seal.verl_plugins"]
    assert int(env["OMP_NUM_THREADS"]) >= 1  # Ray would pin workers to one thread


def test_cpu_recipe_carries_the_cpu_settings():
    from pathlib import Path

    from seal.launch.recipe import compose_recipe

    cfg = compose_recipe(str(Path(__file__).resolve().parents[2] / "exp" / "cpu_tiny.yaml"))
    assert (cfg.trainer.device, cfg.trainer.use_v1, cfg.actor_rollout_ref.rollout.name) == ("cpu", False, "hf")
    assert cfg.ray_kwargs.ray_init.num_gpus == 1
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert cfg.actor_rollout_ref.actor.strategy == cfg.actor_rollout_ref.ref.strategy == "fsdp2"


@pytest.mark.parametrize(
    "name",
    [
        "wake_up",
        "sleep",
        "abort_all_requests",
        "resume_generation",
        "clear_kv_cache",
        "release_kv_cache",
        "resume_kv_cache",
        "start_profile",
        "stop_profile",
    ],
)
def test_server_exposes_every_method_the_replica_forwards(name):
    from verl.workers.rollout.replica import RolloutReplica

    from seal.cpu.hf_rollout import HFRolloutServer

    assert hasattr(RolloutReplica, name) and callable(getattr(HFRolloutServer, name))
