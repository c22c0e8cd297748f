"""Requests that wait for a worker while it is being killed and replaced (real worker processes): a create queued
behind the request the worker died on starts on the replacement, and an episode released during the replacement
is gone for good (the next kill does not rebuild it, scratch folder and all); the replacement is a spare started
before the kill, so the innocent episodes do not wait for a worker to start. (Worker deaths of other causes, and
replays: ``test_env_worker_death.py``.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from env_service.bfcl.config import ServiceLimits
from env_service.episodes.manager import EpisodeManager
from env_service.workers.pool import START_TIMEOUT_S
from tests.support.env_attacks import aliasing_messages, call

OOD_TASK = "memory_kv_prereq_32-notetaker-0"  # an episode with a scratch folder
FS_TASK = "multi_turn_base_0"
# No grace, and room for the find to run into its time budget rather than its memory budget: the worker misses
# the deadline of that message and is killed.
KILLING = ServiceLimits(message_budget_s=1.0, call_budget_s=1.0, worker_grace_s=0.0, call_memory_mib=4096)


def test_a_create_queued_behind_a_killed_workers_request_starts_on_the_replacement():
    manager = EpisodeManager(workers=1, limits=KILLING)
    try:
        worker = manager._pool._workers[0]
        offender = manager.create(FS_TASK, "validate")["instance_id"]
        for message in aliasing_messages():
            manager.step(offender, message)
        outcome = []
        killing = threading.Thread(target=lambda: outcome.append(_lost(manager, offender)))
        killing.start()
        while worker.busy_since is None:  # the find is on the worker
            time.sleep(0.001)
        innocent = manager.create(FS_TASK, "validate")["instance_id"]  # before: 503, the worker holding it replaced
        killing.join()
        assert outcome == [True] and worker.restarts == 1  # the find got its worker killed, its episode lost
        assert manager.step(innocent, call("ls"))["info"]["num_steps"] == 1
    finally:
        manager.close_all()


def _lost(manager, instance_id: str) -> bool:
    try:
        manager.step(instance_id, call("find", path="."))
    except Exception as error:  # noqa: BLE001 - the point: the offender's episode is lost with its worker
        return "lost" in str(error)
    return False


def _kill_and_replace(worker) -> None:
    """SIGKILL ``worker``; returns once the pool's monitor has it replaced (the monitor sees the exit at once)."""
    restarts = worker.restarts
    os.kill(worker.process.pid, signal.SIGKILL)
    _replaced(worker, restarts)


def _replaced(worker, restarts: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while worker.restarts == restarts and time.monotonic() < deadline:  # counted inside the kill
        time.sleep(0.001)
    assert worker.restarts == restarts + 1


def test_an_episode_released_during_its_workers_replacement_is_not_revived():
    manager = EpisodeManager(workers=1)
    try:
        pool = manager._pool
        instance_id = manager.create(OOD_TASK, "validate")["instance_id"]
        worker = pool._workers[0]
        restarts = worker.restarts
        os.kill(worker.process.pid, signal.SIGKILL)
        assert manager.release(instance_id)  # races the monitor's replacement of the worker
        _replaced(worker, restarts)
        assert instance_id not in worker.episodes  # before: listed again by the replay
        _kill_and_replace(worker)
        assert worker.episodes == {}
        assert os.listdir(worker.scratch) == []  # before: its folder made again by a second replay
    finally:
        manager.close_all()


def test_a_killed_workers_replacement_was_started_before_the_kill_and_its_innocent_episode_goes_on():
    manager = EpisodeManager(workers=1, limits=KILLING)
    try:
        pool = manager._pool
        worker = pool._workers[0]
        innocent = manager.create(FS_TASK, "validate")["instance_id"]
        assert manager.step(innocent, call("ls"))["info"]["num_steps"] == 1
        offender = manager.create(FS_TASK, "validate")["instance_id"]
        for message in aliasing_messages():
            manager.step(offender, message)
        started_before = {child.pid for child in psutil.Process().children()}
        dead = worker.process.pid
        assert _lost(manager, offender) and worker.restarts == 1
        # An ordering, not a clock: before, the replacement was a process started after the kill (a cold start the
        # innocent episode waited for); now it is one that was already running when the worker was killed.
        assert worker.process.pid != dead and worker.process.pid in started_before
        assert manager.step(innocent, call("ls"))["info"]["num_steps"] == 2  # rebuilt on it by the replay
        spare = pool.health()["spare_pid"]
        assert spare not in (None, worker.process.pid)  # and the next spare is starting
    finally:
        manager.close_all()
    assert not {worker.process.pid, spare} & {child.pid for child in psutil.Process().children()}  # stopped with it


def test_a_spare_that_died_after_its_start_is_passed_over_for_a_cold_start():
    manager = EpisodeManager(workers=1)
    try:
        pool = manager._pool
        worker = pool._workers[0]
        innocent = manager.create(FS_TASK, "validate")["instance_id"]
        spare = pool._spare
        assert spare.conn.poll(START_TIMEOUT_S)  # its "ready" is waiting, unread
        os.kill(spare.process.pid, signal.SIGKILL)
        spare.process.wait()
        _kill_and_replace(worker)
        assert worker.process is not spare.process and worker.process.poll() is None
        assert manager.step(innocent, call("ls"))["info"]["num_steps"] == 1  # before: replayed onto the dead spare
    finally:
        manager.close_all()
