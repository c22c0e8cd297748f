"""CPU runs: Ray workers use the thread count the user set (else every core this process may use).

Ray starts every worker with OMP_NUM_THREADS=1 unless the runtime env says otherwise; the CPU launch sets it for all
workers. On a shared machine all cores oversubscribe (10-40x slower when other jobs hold them), so a user's
``OMP_NUM_THREADS`` must win — checked here in a real Ray worker's torch.
"""

from __future__ import annotations

import os

import pytest

from seal.cpu.platform import cpu_runtime_env, worker_threads


def test_a_user_set_thread_count_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_threads() == "3" and cpu_runtime_env()["OMP_NUM_THREADS"] == "3"


def test_a_thread_count_in_the_recipes_runtime_env_wins(monkeypatch):
    from pathlib import Path

    from seal.launch.recipe import compose_recipe
    from seal.launch.run_env import ray_runtime_env

    recipe = str(Path(__file__).resolve().parents[2] / "exp" / "cpu_tiny.yaml")
    config = compose_recipe(recipe, ["+ray_kwargs.ray_init.runtime_env.env_vars.OMP_NUM_THREADS='1'"])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = ray_runtime_env(config, cpu_runtime_env())
    assert env.env_vars.OMP_NUM_THREADS == "1"
    assert env.env_vars.VERL_PLATFORM == cpu_runtime_env()["VERL_PLATFORM"]  # ours still there


def test_without_one_every_usable_cpu_as_the_env_workers_count_them(monkeypatch, tmp_path):
    from env_service.workers import sizing

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sizing, "CGROUP_ROOT", tmp_path)  # no cgroup files: the affinity alone
    assert worker_threads() == str(len(os.sched_getaffinity(0)))
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
    assert worker_threads() == str(len(os.sched_getaffinity(0)))
    # a cgroup CPU quota of half a CPU: one thread, however many CPUs the affinity lists (the env workers' count)
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert worker_threads() == "1" == str(sizing.usable_cpus(tmp_path)[0])


@pytest.mark.parametrize("user", ["1", None])
def test_ray_workers_run_torch_with_that_many_threads(monkeypatch, user):
    import ray

    if user is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", user)
    env = cpu_runtime_env()

    @ray.remote(num_cpus=0)
    def threads() -> tuple[str, int]:
        import torch

        return os.environ["OMP_NUM_THREADS"], torch.get_num_threads()

    if ray.is_initialized():  # a cluster left over by an earlier test has another runtime env
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        assert ray.get(threads.remote()) == (env["OMP_NUM_THREADS"], int(env["OMP_NUM_THREADS"]))
    finally:
        ray.shutdown()
    assert env["OMP_NUM_THREADS"] == (user or str(len(os.sched_getaffinity(0))))
