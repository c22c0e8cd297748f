"""Registrations seal makes inside every verl process: the CPU platform, the recipes' advantage estimator
(``seal_grpo``, ``seal/advantage.py``), the ``hf`` rollout backend (and ``scripted``, the instant one of
``scripts/production_shape.py``), and what the CPU build of vLLM needs around
verl's weight update (``seal.cpu.vllm_cpu``; CPU platform with that build only).

Loaded by verl itself at the end of ``import verl``: this module is the ``seal`` entry point in
the ``verl.plugins`` group (pyproject.toml), which ``verl/__init__.py`` loads unless
``VERL_USE_EXTERNAL_PLUGINS=none``. Because Ray workers (TaskRunner, trainer workers, agent-loop
and reward workers, rollout servers) all import verl, the registrations reach every process
without per-actor setup. ``VERL_USE_EXTERNAL_MODULES=seal.verl_plugins`` (set by
``seal.cpu.platform.cpu_runtime_env``) imports this module again by name as a fallback; every
registration is idempotent.

verl swallows exceptions raised by plugin entry points (logged at DEBUG), so each registration
here logs its own failure as a warning instead of disappearing silently.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

HF_ROLLOUT_ADAPTER = "seal.cpu.hf_rollout.HFRolloutAdapter"


def _load_hf_replica():
    # Imported only when the trainer asks for rollout.name=hf (keeps `import verl` cheap).
    from seal.cpu.hf_rollout import HFRolloutReplica

    return HFRolloutReplica


def _load_scripted_replica():
    from seal.cpu.scripted_rollout import ScriptedReplica

    return ScriptedReplica


def register_hf_rollout() -> None:
    """Make `actor_rollout_ref.rollout.name=hf` (and `scripted`) resolvable on both sides.

    verl has no plugin API for rollout backends; both registries are module-level dicts that
    `get_rollout_class` (worker side) and `get_rollout_replica_class` (driver side) read. The scripted server
    takes hf's adapter: it forwards the trainer's weights to a server actor of the same name, which drops them.
    """
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _ROLLOUT_REGISTRY[("hf", "async")] = HF_ROLLOUT_ADAPTER
    RolloutReplicaRegistry.register("hf", _load_hf_replica)
    _ROLLOUT_REGISTRY[("scripted", "async")] = HF_ROLLOUT_ADAPTER
    RolloutReplicaRegistry.register("scripted", _load_scripted_replica)


def register_cpu_platform() -> None:
    """Platform "cpu" always selectable (inert); its fixes only when VERL_PLATFORM=cpu."""
    from seal.cpu import platform as cpu_platform

    cpu_platform.register()
    if cpu_platform.is_requested():
        cpu_platform.activate()


def register_advantage_estimator() -> None:
    """``algorithm.adv_estimator: seal_grpo`` resolvable wherever verl computes advantages (its driver, the TaskRunner):
    registered by importing the module that defines it (verl's ``register_adv_est`` decorator)."""
    import seal.advantage  # noqa: F401


def register_vllm_cpu() -> None:
    """What the CPU build of vLLM needs around verl's vLLM server; only on the CPU platform with that build."""
    from seal.cpu import vllm_cpu

    if vllm_cpu.is_active():
        vllm_cpu.activate()


def register_all() -> None:
    # The platform goes first: nothing may resolve verl's platform singleton before it exists.
    for step in (register_cpu_platform, register_advantage_estimator, register_hf_rollout, register_vllm_cpu):
        try:
            step()
        except Exception:  # noqa: BLE001 - verl would hide it; make it visible, keep verl usable
            logger.warning("seal.verl_plugins: %s failed", step.__name__, exc_info=True)


register_all()
