"""How many env workers a service starts on the node it runs on (env_service/workers/sizing.py), and what the
launcher makes of it: the ``--workers`` it passes, its start wait, the dry run's line. The node is simulated: its
CPU affinity, cgroup files and /proc/meminfo, as a 4-GPU node with 192 CPUs reports them."""

from __future__ import annotations

import os

import pytest

from env_service.workers import sizing
from env_service.workers.sizing import MEMORY_SHARE, WORKER_RSS_BYTES, size_workers, start_wait_s

GIB = 1024**3
NODE_CPUS = set(range(192))  # a 4 x H100 node's vCPUs
NODE_MEMORY = 2048 * GIB  # its MemAvailable


def node(
    tmp_path, cpu_max: str = "max 100000", memory_max: str = "max", memory_current: int = 0, mem_available=NODE_MEMORY
):
    """A cgroup v2 root and a /proc/meminfo in ``tmp_path``; returns (cgroup root, meminfo path)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text(cpu_max + "\n")
    (root / "memory.max").write_text(memory_max + "\n")
    (root / "memory.current").write_text(f"{memory_current}\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {mem_available // 512} kB\nMemAvailable:   {mem_available // 1024} kB\n")
    return root, meminfo


def test_a_4_gpu_node_starts_a_worker_per_cpu_when_the_peak_and_memory_allow_more(tmp_path):
    root, meminfo = node(tmp_path)
    found = size_workers(peak_episodes=256, cgroup_root=root, meminfo=meminfo, affinity=NODE_CPUS)
    assert found.workers == len(NODE_CPUS)
    assert "192 in this process's CPU affinity" in found.reason
    assert found.memory_bytes == (len(NODE_CPUS) + 1) * WORKER_RSS_BYTES  # the spare too


def test_a_job_given_part_of_the_node_gets_its_affinity_not_the_host_cores(tmp_path):
    root, meminfo = node(tmp_path)
    job = set(range(48, 96))
    assert size_workers(256, root, meminfo, affinity=job).workers == len(job)


def test_a_cgroup_v2_quota_caps_the_cpus_rounded_up(tmp_path):
    root, meminfo = node(tmp_path, cpu_max="1550000 100000")  # 15.5 CPUs' worth of time
    found = size_workers(256, root, meminfo, affinity=NODE_CPUS)
    assert found.workers == 16
    assert "quota 15.5" in found.reason


def test_a_cgroup_v1_quota_caps_the_cpus(tmp_path):
    root = tmp_path / "v1"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("800000\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{2**63 - 4096}\n")  # v1's "unlimited"
    (root / "memory" / "memory.usage_in_bytes").write_text("0\n")
    _, meminfo = node(tmp_path)
    assert size_workers(256, root, meminfo, affinity=NODE_CPUS).workers == 8


def test_no_more_workers_than_episodes_at_once(tmp_path):
    root, meminfo = node(tmp_path)
    found = size_workers(peak_episodes=24, cgroup_root=root, meminfo=meminfo, affinity=NODE_CPUS)
    assert found.workers == 24
    assert "episode" in found.reason


def test_a_cgroup_memory_limit_caps_the_workers_to_its_share_of_the_room_left(tmp_path):
    wanted = 10  # workers whose memory, with the spare's, is exactly the share of the room left
    room = int((wanted + 1) * WORKER_RSS_BYTES / MEMORY_SHARE)
    used = 3 * GIB
    root, meminfo = node(tmp_path, memory_max=str(room + used), memory_current=used)
    found = size_workers(256, root, meminfo, affinity=NODE_CPUS)
    assert found.workers == wanted
    assert "available" in found.reason


def test_meminfo_caps_the_workers_when_the_cgroup_has_no_limit(tmp_path):
    wanted = 40
    root, meminfo = node(tmp_path, mem_available=int((wanted + 1) * WORKER_RSS_BYTES / MEMORY_SHARE))
    assert size_workers(256, root, meminfo, affinity=NODE_CPUS).workers == wanted


def test_at_least_one_worker_however_little_memory(tmp_path):
    root, meminfo = node(tmp_path, mem_available=WORKER_RSS_BYTES)
    found = size_workers(256, root, meminfo, affinity=NODE_CPUS)
    assert found.workers == 1
    assert "at least one" in found.reason


def test_the_start_wait_grows_with_the_workers_started():
    assert start_wait_s(192) - start_wait_s(2) == (193 - 3) * sizing.WORKER_START_CPU_S
    assert start_wait_s(2) > sizing.BASE_START_WAIT_S


@pytest.fixture
def big_node(tmp_path, monkeypatch):
    """This process on the simulated 4-GPU node: the sizing's files and affinity are the node's."""
    root, meminfo = node(tmp_path)
    monkeypatch.setattr(sizing, "CGROUP_ROOT", root)
    monkeypatch.setattr(sizing, "MEMINFO", meminfo)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: NODE_CPUS)


def test_the_launcher_passes_the_sized_workers_and_waits_as_long_as_they_take(big_node, monkeypatch, tmp_path):
    from seal.launch import service

    waited = []
    monkeypatch.setattr(service.LocalService, "_spawn", lambda self: None)
    monkeypatch.setattr(service, "wait_healthy", lambda url, proc, service_id, timeout_s: waited.append(timeout_s))
    local = service.LocalService(str(tmp_path / "secret"), "id", flags=["--peak-episodes", "256"])
    try:
        local.start()
    finally:
        local._listener.close()
    assert local.flags[local.flags.index("--workers") + 1] == str(len(NODE_CPUS))
    assert waited == [start_wait_s(len(NODE_CPUS))]


def test_the_launcher_keeps_workers_the_recipe_sets(big_node, tmp_path):
    from seal.launch import service

    local = service.LocalService(str(tmp_path / "secret"), "id", flags=["--workers", "6", "--peak-episodes", "256"])
    local._listener.close()
    assert local.flags.count("--workers") == 1
    assert local.workers.workers == 6
    assert local.workers.start_wait_s == start_wait_s(6)


def test_the_dry_run_prints_the_workers_their_memory_and_why(big_node, capsys):
    from seal.launch.cli import dry_run
    from seal.launch.recipe import compose_recipe
    from seal.launch.service import peak_episodes

    assert peak_episodes(compose_recipe("exp/SEAL.yaml")) > len(NODE_CPUS)  # so the CPUs set the number
    dry_run("exp/SEAL.yaml", [])
    line = next(line for line in capsys.readouterr().out.splitlines() if "environment service on this node" in line)
    workers = len(NODE_CPUS)
    assert f"{workers} env worker(s) + 1 spare" in line
    assert f"{(workers + 1) * WORKER_RSS_BYTES / 1024**2:,.0f} MiB" in line
    assert "CPU affinity" in line
    assert f"start wait {start_wait_s(workers):.0f} s" in line
