"""The run's environment: the variables every process of the run gets (the CPU platform, where verl's loggers
write), set in this process and in the Ray runtime env, and this process's connection to the run's Ray cluster.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def run_environment(config: DictConfig) -> dict[str, str]:
    """Environment variables of every process of the run: CPU platform (CPU recipes) and logger locations."""
    from seal.cpu.platform import cpu_runtime_env
    from seal.cpu.vllm_cpu import runtime_env as vllm_cpu_env

    env = {**cpu_runtime_env(), **vllm_cpu_env()} if config.trainer.device == "cpu" else {}
    # verl warns at every import about optional engines (megatron, torchtitan, ...) that seal does not use
    env["PYTHONWARNINGS"] = os.environ.get("PYTHONWARNINGS", "ignore::UserWarning:verl.workers.engine")
    return {**env, **logger_locations(Path(config.seal.run_dir).resolve())}


#: The run folder whose logger locations this process's environment holds, set with them.
LOGGERS_OF_RUN = "SEAL_LOGGERS_OF_RUN"


def logger_locations(run_dir: Path) -> dict[str, str]:
    """Where verl's file and tensorboard loggers write (by default relative to the cwd): in the run folder.

    A location already in the environment wins when the user set it, or when this run set it (calling again keeps
    the metrics file's name). One set for another run (a second run in the same process, or a process started
    after one) is not the user's: this run derives its own rather than log into that run's folder."""
    derived = {
        "TENSORBOARD_DIR": str(run_dir / "tensorboard"),
        "VERL_FILE_LOGGER_PATH": str(run_dir / f"metrics_{time.strftime('%Y%m%d-%H%M%S')}.jsonl"),
    }
    if os.environ.get(LOGGERS_OF_RUN, str(run_dir)) == str(run_dir):
        derived = {key: os.environ.get(key, value) for key, value in derived.items()}
    return {**derived, LOGGERS_OF_RUN: str(run_dir)}


def ray_runtime_env(config: DictConfig, env_vars: dict[str, str]):
    """The Ray runtime env of the run: our variables, under what the recipe's ``ray_kwargs.ray_init.runtime_env``
    sets itself (e.g. ``env_vars.OMP_NUM_THREADS`` for a shared CPU machine wins over our core count)."""
    return OmegaConf.merge({"env_vars": env_vars}, config.ray_kwargs.ray_init.get("runtime_env") or {})


def set_run_environment(config: DictConfig) -> None:
    """The run's environment variables (``run_environment``) in this process and in the run's Ray runtime env.

    Set before verl is imported here (the platform is chosen at import). A local Ray cluster this process starts
    inherits them; a cluster started elsewhere (`ray start`) gets them through the runtime env. Calling it again
    changes nothing (the variables it derives keep the values already set)."""
    env_vars = run_environment(config)
    Path(config.seal.run_dir).mkdir(parents=True, exist_ok=True)  # verl's file logger writes there
    os.environ.update(env_vars)
    OmegaConf.set_struct(config, False)
    config.ray_kwargs.ray_init.runtime_env = ray_runtime_env(config, env_vars)


def connect_ray(config: DictConfig) -> None:
    """Connect this process to the run's Ray cluster (``ray_kwargs.ray_init.address``, else ``auto``) with the runtime
    env verl's ``run_ppo`` would give it (verl's defaults under the run's own), so that run_ppo, finding the process
    connected, uses this connection: what the launcher starts on the cluster belongs to the run's driver."""
    import ray

    set_run_environment(config)
    ray.init(
        address=config.ray_kwargs.ray_init.get("address") or "auto",  # a cluster started with `ray start`
        runtime_env=verl_runtime_env(config),
    )


def verl_runtime_env(config: DictConfig) -> dict:
    """The runtime env verl's ``run_ppo`` gives the run's Ray processes: verl's defaults under the run's own
    (``ray_kwargs.ray_init.runtime_env``, with ``set_run_environment``'s variables once it has run)."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    merged = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
    return OmegaConf.to_container(merged, resolve=True)
