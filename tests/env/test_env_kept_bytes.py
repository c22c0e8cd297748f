"""What the service keeps for a client is counted in bytes, measured. An idle episode counts what it holds
from its creation (checked against the memory the service and its worker really grow by); kept verdicts and failure
profiles are kept as bytes and budgeted in bytes, per client and in total."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient, EnvServiceError
from env_service.episodes.manager import EpisodeManager
from env_service.errors import UnknownInstance
from env_service.http.service import ServerThread
from tests.support.processes import repo_environment

MIB = 2**20

IDLE_EPISODES = 80


def _rss(*pids: int) -> int:
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def measure_idle_episodes() -> list[tuple[str, float, float]]:
    """(task, bytes counted, bytes the service and its worker grew by) per idle episode, for a small backend state
    and a large one; with every episode still live, the client's total checked against what it was told."""
    measured = []
    with ServerThread(EpisodeManager(workers=1)) as server, EnvClient(server.url, retries=0) as client:
        worker, live = server.manager.health()["per_worker"][0]["pid"], []
        for task_id in ("multi_turn_base_0", "multi_turn_long_context_0"):
            for _ in range(10):  # the allocators' first growth is not the episodes'
                client.release(client.create(task_id, "validate")["instance_id"])
            gc.collect()
            before = _rss(psutil.Process().pid, worker)
            created = [client.create(task_id, "validate") for _ in range(IDLE_EPISODES)]
            gc.collect()
            time.sleep(0.2)
            grown = (_rss(psutil.Process().pid, worker) - before) / IDLE_EPISODES
            measured.append((task_id, sum(c["info"]["kept_bytes"] for c in created) / IDLE_EPISODES, grown))
            live.extend(created)  # kept until the end: memory they free would be reused by the next ones
        assert server.manager._client_bytes["addr:loopback"] == sum(c["info"]["kept_bytes"] for c in live)
        for c in live:
            client.release(c["instance_id"])
    return measured


def test_an_idle_episode_counts_what_it_holds_in_the_service_and_its_worker():
    """Before: an episode created and never stepped counted its prompt (~25 KB) while the service and its worker grew
    by ~154 KB for it (its own copy of the task, its backends' state, the service's copies of its first answer).

    Measured in a fresh interpreter: after a long test session this process reuses memory freed by earlier tests,
    and grows by less than what it allocates."""
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=300, env=repo_environment()
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for task_id, counted, grown in json.loads(done.stdout.splitlines()[-1]):
        assert 0.6 < counted / grown < 1.6, (task_id, counted, grown)


# ---------------------------------------------------------------------------------------------
# Hole 1: kept verdicts, failure profiles and scratch folders in bytes
# ---------------------------------------------------------------------------------------------

#: A memory of many short entries: as Python objects it costs many times its JSON (~0.9 MB).
SNAPSHOT = {"core_memory": {}, "archival_memory": {f"k{i}": f"note {i}" for i in range(40_000)}}


def _prerequisite() -> str:
    """A memory prerequisite that is not its scenario's first (the first starts empty whatever it is given), so its
    evaluation hands back the memory it was given."""
    from env_service.bfcl.ood_tasks import KIND_PREREQ, load_ood_task, ood_task_ids

    prerequisites = [t for t in ood_task_ids("memory_kv", include_prereq=True) if load_ood_task(t).kind == KIND_PREREQ]
    return prerequisites[1]


def test_kept_verdicts_of_memory_episodes_are_budgeted_in_measured_bytes():
    """Before: each kept verdict held its ~0.9 MB snapshot as Python objects (~7 MiB), and only their number was
    limited (2,048 a client: ~14 GiB)."""
    budget = 2 * MIB
    manager = EpisodeManager(limits=ServiceLimits(evaluation_bytes_kept_per_client=budget))
    task_id, finished = _prerequisite(), []
    me = psutil.Process()
    for k in range(4):
        instance_id = manager.create(task_id, "validate", memory_snapshot=SNAPSHOT, owner="client")["instance_id"]
        verdict = manager.evaluate(instance_id, release=True, owner="client")
        assert verdict["memory_snapshot"] == SNAPSHOT
        finished.append(instance_id)
        if k == 0:  # the memory one episode takes, and frees, is there from now on: only what is kept grows
            gc.collect()
            after_first = me.memory_info().rss
    gc.collect()
    grown = me.memory_info().rss - after_first
    assert grown < 6 * budget, f"{grown / MIB:.0f} MiB"  # before: ~21 MiB (3 verdicts of ~7 MiB)
    assert manager._verdicts.bytes_of("client") <= budget
    assert manager.evaluate(finished[-1], release=True, owner="client")["memory_snapshot"] == SNAPSHOT  # a retry
    with pytest.raises(UnknownInstance):  # the oldest: evicted by the client's own newer ones
        manager.evaluate(finished[0], release=True, owner="client")
    manager.close_all()


def test_an_ood_episode_counts_the_files_of_its_scratch_folder():
    """The memory an OOD episode is given is written to its scratch folder for bfcl to load: its bytes count too."""
    manager = EpisodeManager()
    created = manager.create(_prerequisite(), "validate", memory_snapshot=SNAPSHOT)
    scratch = manager._slots[created["instance_id"]].episode._scratch
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(scratch) for f in files)
    assert on_disk > len(json.dumps(SNAPSHOT)) / 2 and created["info"]["kept_bytes"] > 2 * on_disk  # files and memory
    manager.close_all()


def test_failure_profiles_are_budgeted_in_bytes_per_client_and_in_total():
    limits = ServiceLimits(profile_bytes_kept_per_client=2 * MIB, profile_bytes_kept=3 * MIB)
    profile = {"notes": "x" * 900_000}
    with ServerThread(EpisodeManager(limits=limits)) as server:
        pushes = {}
        for run_id in ("a", "b", "c"):  # one client (loopback), three runs: the third is over its 2 MiB
            with EnvClient(server.url, run_id=run_id, retries=0) as client:
                try:
                    pushes[run_id] = client.set_profile(profile)["version"]
                except EnvServiceError as error:
                    pushes[run_id] = error.status
        assert pushes == {"a": 1, "b": 2, "c": 429}  # before: all three kept
        with EnvClient(server.url, run_id="a", retries=0) as client:
            assert client.set_profile({"small": 1})["version"] == 3  # replacing its own profile frees its old bytes
            assert client.get_profile()["profile"] == {"small": 1}
    manager = EpisodeManager(limits=limits)  # in total: runs without live episodes give way, oldest first
    for k, run_id in enumerate(("p", "q", "r", "s")):
        manager.set_profile(profile, run_id=run_id, client=f"client-{k}")
    assert [manager.get_profile(run)["version"] for run in ("p", "q", "r", "s")] == [0, 2, 3, 4]


if __name__ == "__main__":  # test_an_idle_episode_counts_what_it_holds_in_the_service_and_its_worker's measurement
    print(json.dumps(measure_idle_episodes()))
