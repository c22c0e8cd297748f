"""How many episode workers a service starts when it is not told (``serve`` without ``--workers``), and why.

One per CPU this process may use, not per core of the host: ``os.cpu_count()`` ignores the CPU affinity a scheduler
gives a job (Slurm, ``taskset``) and a container's CPU quota, and on a GPU node with 200 cores it started 200 workers
for a job allowed a few dozen. Never more than the episodes the trainer runs at once (``--peak-episodes``): an
episode lives on one worker, so a worker beyond that never holds one. And no more than a share of the memory
available fits (:data:`MEMORY_SHARE`: the rest is the trainer's, on the same node).

The cgroup files read are those at ``cgroup_root`` (``/sys/fs/cgroup``): the cgroup a container or a job step is
mounted with there, as Docker, Kubernetes and Slurm's cgroup plugin show it to the processes inside.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
MIB = 1024**2

#: Resident memory of one idle worker: imports and the task table. Measured 2026-12-06 on a fresh
#: ``python -m env_service serve --workers 2`` (three worker processes with the spare): 118.7 MiB RSS each
#: (107 MiB anonymous), the service process itself 168 MiB. Episodes add to it (about 1 MiB each for ground-truth
#: episodes), bounded per client by ``max_owner_bytes`` whatever the worker count.
WORKER_RSS_BYTES = 120 * MIB
#: The share of the memory available the workers (and their spare) may take: the node's trainer needs the rest
#: (Ray's object store takes 30 % of memory by default; verl's offloaded weights and optimizer, vLLM, data loaders).
MEMORY_SHARE = 0.25
#: CPU seconds one worker takes to start (interpreter, imports, the task table): 0.82-0.88 s each, measured with
#: the RSS above. The start wait counts them one after another, as on a node whose other processes take every core.
WORKER_START_CPU_S = 1.0
#: What the launcher waited for any service before the wait was sized: a few workers on a loaded machine.
BASE_START_WAIT_S = 120.0


@dataclass(frozen=True)
class WorkerSizing:
    workers: int
    reason: str  # which limit set the number (or who gave it)

    @property
    def memory_bytes(self) -> int:
        """What the workers and their spare hold when idle (none with ``--workers 0``: episodes in the service)."""
        return (self.workers + 1) * WORKER_RSS_BYTES if self.workers else 0

    @property
    def start_wait_s(self) -> float:
        return start_wait_s(self.workers)

    def describe(self) -> str:
        return (
            f"{self.workers} env worker(s) + 1 spare, about {self.memory_bytes / MIB:,.0f} MiB idle "
            f"({WORKER_RSS_BYTES // MIB} MiB each): {self.reason}; start wait {self.start_wait_s:.0f} s"
        )


def start_wait_s(workers: int) -> float:
    """How long a service of ``workers`` workers may take to answer ``/health``: every worker is up before it does."""
    return BASE_START_WAIT_S + (workers + 1 if workers else 0) * WORKER_START_CPU_S


def size_workers(
    peak_episodes: int | None = None,
    cgroup_root: str | os.PathLike | None = None,
    meminfo: str | os.PathLike | None = None,
    affinity: set[int] | None = None,
) -> WorkerSizing:
    """The workers a service on this node starts: the fewest of the usable CPUs, ``peak_episodes`` (None: no such
    limit) and what fits in :data:`MEMORY_SHARE` of the memory available, at least one. ``affinity`` stands for
    ``os.sched_getaffinity(0)``, ``cgroup_root`` and ``meminfo`` for :data:`CGROUP_ROOT` and :data:`MEMINFO` (a
    simulated node in tests)."""
    cgroup_root = CGROUP_ROOT if cgroup_root is None else cgroup_root
    cpus, cpus_why = usable_cpus(cgroup_root, affinity)
    available = available_memory(cgroup_root, MEMINFO if meminfo is None else meminfo)
    limits = [(cpus, f"one per usable CPU ({cpus_why})")]
    if peak_episodes is not None:
        limits.append((peak_episodes, f"one per episode the trainer runs at once ({peak_episodes})"))
    if available is not None:
        fits = int(available * MEMORY_SHARE) // WORKER_RSS_BYTES - 1  # the spare is one more
        limits.append((fits, f"{MEMORY_SHARE:.0%} of {available / MIB:,.0f} MiB available"))
    workers, reason = min(limits, key=lambda limit: limit[0])
    if workers < 1:
        workers, reason = 1, f"at least one, though {reason} allows none"
    return WorkerSizing(workers=workers, reason=reason)


def usable_cpus(cgroup_root: str | os.PathLike, affinity: set[int] | None = None) -> tuple[int, str]:
    """CPUs this process may run on (its affinity), fewer under a cgroup CPU quota (rounded up: a quota of 1.5 CPUs
    keeps two workers busy part of the time); with what set them."""
    affinity = os.sched_getaffinity(0) if affinity is None else affinity
    cpus, why = len(affinity), f"{len(affinity)} in this process's CPU affinity"
    quota = cpu_quota(Path(cgroup_root))
    if quota is not None and math.ceil(quota) < cpus:
        cpus, why = math.ceil(quota), f"cgroup CPU quota {quota:g} of {len(affinity)} CPUs in the affinity"
    return max(cpus, 1), why


def cpu_quota(root: Path) -> float | None:
    """CPUs' worth of time the cgroup allows (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``);
    None when unlimited or not there."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, period = v2.split()
        return None if quota == "max" else int(quota) / int(period)
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota is None or period is None or int(quota) < 0:  # -1: unlimited
        return None
    return int(quota) / int(period)


def available_memory(cgroup_root: str | os.PathLike, meminfo: str | os.PathLike) -> int | None:
    """Bytes that can still be used: the node's ``MemAvailable``, less when the cgroup's limit leaves less room (its
    limit less its usage); None when neither says."""
    room = [r for r in (_meminfo_available(Path(meminfo)), _cgroup_room(Path(cgroup_root))) if r is not None]
    return min(room) if room else None


def _cgroup_room(root: Path) -> int | None:
    for limit_file, usage_file in (
        (root / "memory.max", root / "memory.current"),  # v2
        (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes"),  # v1
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None:
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "unlimited" with a page-rounded 2**63
            return None
        return max(int(limit) - int(usage or 0), 0)
    return None


def _meminfo_available(path: Path) -> int | None:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # kB
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
