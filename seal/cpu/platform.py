"""verl platform plugin for CPU-only machines (dev boxes, CI).

verl 0.9.1 knows only CUDA/NPU/ROCm platforms. With this plugin the *unchanged* verl trainer
(`RayPPOTrainer`, FSDP2 engine workers, agent-loop rollout) runs on CPU over gloo. It is inert
unless ``VERL_PLATFORM=cpu``: :mod:`seal.verl_plugins` (a ``verl.plugins`` entry point, loaded
at the end of ``import verl`` in every process) registers the platform everywhere (:func:`register`,
inert: never auto-detected) but calls :func:`activate` only then, so GPU runs are unaffected.

What activation does, and why:

* registers ``PlatformCPU`` (:func:`platform_class`) as verl platform ``"cpu"`` (selected by ``VERL_PLATFORM=cpu``);
  its ``device_module`` is a shim standing in for ``torch.cuda`` on top of ``torch.cpu``;
* reports the Ray accelerator resource as ``"GPU"``: ``ResourcePoolManager`` hard-codes
  ``use_gpu=True`` and counts only GPU/NPU node resources, so CPU runs start Ray with a fake
  logical GPU (``ray_kwargs.ray_init.num_gpus``); Ray then sets ``CUDA_VISIBLE_DEVICES``, which the
  CPU torch build ignores;
* makes the FSDP engine resolvable on device ``cpu``: verl registers it for cuda/npu only, and
  ``EngineRegistry.get_engine_cls`` honours ``VERL_ENGINE_DEVICE`` (its documented override),
  so it is defaulted to ``cuda`` -- the FSDP engine itself then runs on whatever
  ``get_device_name()`` says, i.e. ``cpu``;
* wraps ``initialize_global_process_group_ray`` (and the non-Ray variant): by default they
  build ``"cpu:gloo,{device}:{backend}"``, which on CPU becomes ``"cpu:gloo,cpu:gloo"`` and torch
  rejects the duplicate device type; plain ``"gloo"`` is what we need.

:func:`cpu_runtime_env` is the Ray environment a CPU launch needs; the config side (device, fake GPU
resource, fp32 FSDP2, sdpa, the ``hf`` rollout) lives in the recipe, ``exp/cpu_tiny.yaml``; the fix that FSDP2's
CPU offload must not pin memory is applied at activation.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import types
from contextlib import contextmanager
from typing import Any

import torch

# NOTE: no verl import at module level. verl's plugin loader imports this module (through
# seal.verl_plugins) *during* `import verl`; if this module were imported first (launcher, tests)
# and imported verl at the top, verl would re-enter it half-initialized. verl is imported lazily
# in platform_class() / activate() instead.

logger = logging.getLogger(__name__)

PLATFORM_NAME = "cpu"


def is_requested() -> bool:
    """True when this process was asked to run verl on CPU."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


# ---------------------------------------------------------------------------------------------
# Device-module shim: verl calls `get_torch_device().<fn>()` where it would call torch.cuda.<fn>.
# ---------------------------------------------------------------------------------------------


def _zero(*_args, **_kwargs) -> int:
    return 0


def _noop(*_args, **_kwargs) -> None:
    return None


def _mem_get_info(*_args, **_kwargs) -> tuple[int, int]:
    """(free, total) host memory, so memory logging code has real numbers."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        return 0, 0


class _CpuDeviceProperties:
    name = "cpu"

    @property
    def total_memory(self) -> int:
        return _mem_get_info()[1]


def _build_device_module() -> types.ModuleType:
    """A module object that answers the torch.cuda API subset verl uses, backed by torch.cpu."""
    mod = types.ModuleType("seal_cpu_device")
    # torch.cpu already provides: is_available, current_device ('cpu'), device_count, set_device,
    # synchronize, current_stream, stream, Stream, Event. Copy them over, then add the rest.
    from_torch_cpu = ("is_available", "current_device", "device_count", "set_device", "synchronize")
    for name in from_torch_cpu + ("current_stream", "stream", "Stream", "Event"):
        setattr(mod, name, getattr(torch.cpu, name))
    extras = {
        "get_device_name": lambda *_a, **_k: "cpu",  # flops_counter does `"H100" in name`
        "get_device_capability": lambda *_a, **_k: (None, None),
        "get_device_properties": lambda *_a, **_k: _CpuDeviceProperties(),
        "is_bf16_supported": lambda *_a, **_k: True,
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
        "seed": torch.seed,
        "initial_seed": torch.initial_seed,
        "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
        "set_rng_state": lambda state, *_a, **_k: torch.set_rng_state(state),
        "mem_get_info": _mem_get_info,
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "reset_peak_memory_stats": _noop,
        "reset_accumulated_memory_stats": _noop,
        "set_per_process_memory_fraction": _noop,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
    }
    for name, fn in extras.items():
        setattr(mod, name, fn)
    return mod


CPU_DEVICE_MODULE = _build_device_module()


# ---------------------------------------------------------------------------------------------
# The platform
# ---------------------------------------------------------------------------------------------


class PlatformCPUMethods:
    """The CPU implementation of verl's PlatformBase interface (see platform_class())."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: CPU is chosen explicitly with VERL_PLATFORM=cpu, so a GPU box (or a
        # CPU-only Ray actor on a GPU cluster) keeps verl's own detection.
        return False

    def current_device(self) -> str:
        # verl does `tensor.to(get_device_id())`; an int would mean cuda:<id>, "cpu" works.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None  # e.g. "expandable_segments:True" is a CUDA caching-allocator knob

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets CUDA_VISIBLE_DEVICES for the fake "GPU" resource; reading it is harmless.
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        # See module docstring: verl's resource pools only count GPU/NPU resources.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None


_platform_cls: type | None = None


def platform_class() -> type:
    """verl platform class ``PlatformCPU`` (a PlatformBase subclass), created on first use."""
    global _platform_cls
    if _platform_cls is None:
        from verl.plugin.platform import PlatformBase

        _platform_cls = type("PlatformCPU", (PlatformCPUMethods, PlatformBase), {"__module__": __name__})
    return _platform_cls


# ---------------------------------------------------------------------------------------------
# Process-group backend fix
# ---------------------------------------------------------------------------------------------

# Modules that bind `initialize_global_process_group_ray` by name (`from ... import`); if one was
# imported before activation, its binding is patched too.
_PG_RAY_IMPORTERS = ("verl.workers.engine_workers", "verl.checkpoint_engine.base")


def _gloo_backend_wrapper(original):
    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        # Keep explicit backends (checkpoint_engine passes "cpu:gloo"); replace only the
        # default "cpu:gloo,cpu:gloo", which torch rejects.
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray.__seal_cpu_patched__ = True
    return initialize_global_process_group_ray


def _patch_process_group_init() -> None:
    import verl.utils.distributed as dist_utils

    current = dist_utils.initialize_global_process_group_ray
    if getattr(current, "__seal_cpu_patched__", False):
        return
    patched = _gloo_backend_wrapper(current)
    dist_utils.initialize_global_process_group_ray = patched
    for name in _PG_RAY_IMPORTERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "initialize_global_process_group_ray", None) is current:
            module.initialize_global_process_group_ray = patched
    _patch_torchrun_process_group_init(dist_utils)


def _patch_torchrun_process_group_init(dist_utils) -> None:
    """Same duplicate-backend problem in the torchrun variant (SFT / model merger paths)."""
    original = dist_utils.initialize_global_process_group

    @functools.wraps(original)
    def initialize_global_process_group(timeout_second=36000):
        from datetime import timedelta

        torch.distributed.init_process_group(
            backend="gloo",
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    dist_utils.initialize_global_process_group = initialize_global_process_group


# ---------------------------------------------------------------------------------------------
# Activation
# ---------------------------------------------------------------------------------------------

_activated = False


def register() -> None:
    """Make verl platform "cpu" selectable in this process (idempotent, inert).

    Registered in every verl process, not only CPU runs: a process that sets VERL_PLATFORM=cpu
    after `import verl` (a driver, say) then still resolves the platform instead of failing with
    "Unknown platform 'cpu'". Registration alone changes nothing: the platform is never
    auto-detected (is_platform_available is False) and has no side effects until selected."""
    from verl.plugin.platform import PlatformRegistry

    if PlatformRegistry.get(PLATFORM_NAME) is not platform_class():
        PlatformRegistry.register(platform=PLATFORM_NAME)(platform_class())


def activate() -> None:
    """Register the CPU platform and apply the CPU fixes in this process (idempotent).

    Called at `import verl` when VERL_PLATFORM=cpu is already set -- true for every Ray worker of
    a CPU run, which are the processes that build engines and process groups."""
    global _activated
    if _activated:
        return
    register()
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # FSDP engine lookup, see module docstring
    _patch_process_group_init()
    _unpin_cpu_offload()
    _activated = True


def _unpin_cpu_offload() -> None:
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (verl's reference policy always uses it) pins host memory,
    which needs an accelerator; on a CPU-only machine the parameters already live in host memory, so the
    policy is kept and only the pinning is dropped."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if getattr(CPUOffloadPolicy.__init__, "__seal_cpu_patched__", False):
        return
    original = CPUOffloadPolicy.__init__

    @functools.wraps(original)
    def __init__(self, pin_memory: bool = True):
        original(self, pin_memory=False)

    __init__.__seal_cpu_patched__ = True
    CPUOffloadPolicy.__init__ = __init__


# ---------------------------------------------------------------------------------------------
# What a CPU launch needs (launcher, recipes, tests)
# ---------------------------------------------------------------------------------------------

# Env for every Ray worker. The trainer's workers inherit the driver's environment when the driver
# starts the local Ray cluster, but an existing cluster (`ray start`) would not, so a launcher also
# passes these through `ray_kwargs.ray_init.runtime_env.env_vars` (seal.launch.run_env.run_environment).
CPU_ENV = {
    "VERL_PLATFORM": "cpu",
    # Belt and braces for the entry point: verl also imports modules named here, so the
    # registrations happen even if the `seal` dist-info (entry points) is stale or missing.
    "VERL_USE_EXTERNAL_MODULES": "seal.verl_plugins",
    # HF tokenizers' thread pool on a 2-core box shared by ~6 processes only adds contention.
    "TOKENIZERS_PARALLELISM": "false",
}


def cpu_runtime_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Env vars every Ray worker of a CPU run needs (also to export in the driver before `import verl`)."""
    env = dict(CPU_ENV)
    env["OMP_NUM_THREADS"] = worker_threads()
    user_modules = os.environ.get("VERL_USE_EXTERNAL_MODULES", "")
    env["VERL_USE_EXTERNAL_MODULES"] = _merge_module_list(user_modules, env["VERL_USE_EXTERNAL_MODULES"])
    env.update(extra_env or {})
    return env


def worker_threads() -> str:
    """Torch threads for every Ray worker of a CPU run: ``OMP_NUM_THREADS`` if the user set it, else every CPU
    this process may use (its affinity, fewer under a cgroup CPU quota).

    Ray pins OMP_NUM_THREADS=1 in every worker unless the runtime env sets it; one thread makes the trainer worker's
    log-prob and update passes (152k-vocab logits), the CPU path's bottleneck, many times slower. All cores is
    right for a machine of one's own; on a shared or busy one it oversubscribes (10-40x slower when other jobs
    hold the cores), so a user-set value wins."""
    user = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) > 0:
        return user
    from env_service.workers.sizing import CGROUP_ROOT, usable_cpus

    return str(usable_cpus(CGROUP_ROOT)[0])  # the count the env workers are sized by: affinity, cgroup quota


def _merge_module_list(existing: str, ours: str) -> str:
    """Keep modules the user already listed (comma list), add ours once."""
    names = [n.strip() for n in existing.split(",") if n.strip()]
    return ",".join(names + [ours] if ours not in names else names)
