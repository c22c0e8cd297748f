"""Worker processes that die of causes no episode's own request is to blame for, against the real service (real
worker processes, real bfcl backends):

* a worker killed between requests (the OOM killer, an operator) is replaced the moment it exits, and every episode
  it held goes on, a finished one with its verdict;
* a worker killed under a request is replaced and the request served on the replacement;
* replies that iterate sets of strings are the same bytes on every worker (one hash seed), so a replay on another
  worker answers as the original did;
* one owner's slow episodes on a killed worker do not use up another owner's replay: each episode's replay has a
  budget of its own, and the episode whose request killed the worker is the one that is lost;
* the monitor keeps reading heartbeats and seeing exits once descriptor numbers pass 1024, without spinning.
"""

from __future__ import annotations

import os
import resource
import signal
import threading
import time

import pytest
import requests

from env_service import replay
from env_service.bfcl import tasks
from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread
from env_service.workers.pool import HEARTBEAT_TIMEOUT_S, START_TIMEOUT_S
from tests.support.env_attacks import aliasing_messages, call

PASSING_TASK = "multi_turn_base_2"
TICKET_TASK = "multi_turn_base_24"  # TicketAPI; ticket 987654 exists in its initial state
NOTICED_WITHIN_S = 3.0  # a death between requests is noticed within this (before: by the 15 s reclaim loop, at best)


def _replaced(worker, generation: int) -> bool:
    """Whether the pool took ``worker`` (in ``generation`` when it was killed) down within ``NOTICED_WITHIN_S``
    without a request to find it dead; then waits for its replacement to be in place (a start takes seconds)."""
    deadline = time.monotonic() + NOTICED_WITHIN_S
    while worker.generation == generation and time.monotonic() < deadline:
        time.sleep(0.01)
    if worker.generation == generation:
        return False
    deadline = time.monotonic() + START_TIMEOUT_S
    while (worker.process.poll() is not None or not worker.scratch) and time.monotonic() < deadline:
        time.sleep(0.01)
    return worker.process.poll() is None


def _sent(stopped_worker) -> None:
    """Wait (bounded) until a request is on its way to ``stopped_worker`` (SIGSTOPped: it stays there)."""
    deadline = time.monotonic() + 30
    while stopped_worker.busy_since is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert stopped_worker.busy_since is not None


def _finished(client, task_id: str) -> str:
    """An episode of ``task_id`` played to its end with the ground truth."""
    instance_id = client.create(task_id, "validate")["instance_id"]
    for message in replay.ground_truth_messages(tasks.load_task(task_id)):
        client.step(instance_id, message)
    return instance_id


def test_a_worker_killed_between_requests_is_replaced_at_once_and_no_episode_on_it_is_lost():
    manager = EpisodeManager(workers=1)
    with ServerThread(manager) as server, EnvClient(server.url, retries=0, timeout_s=60) as client:
        finished = _finished(client, PASSING_TASK)
        verdict = client.evaluate(finished)
        live = client.create(PASSING_TASK, "validate")["instance_id"]
        client.step(live, call("ls"))
        worker = manager._pool._workers[0]
        generation = worker.generation
        os.kill(worker.process.pid, signal.SIGKILL)
        # Before: noticed by the next request (or the reclaim loop, 15 s later), which was blamed and lost.
        assert _replaced(worker, generation), "the dead worker was not replaced until a request came"
        assert client.evaluate(finished, release=True) == verdict  # the finished episode's verdict survives
        assert client.step(live, call("ls"))["info"]["num_steps"] == 2  # the live one goes on where it was
        health = requests.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["workers"]["worker_restarts"] == 1


def test_a_worker_killed_under_a_request_is_replaced_and_the_request_served_on_the_replacement():
    manager = EpisodeManager(workers=1)
    try:
        instance_id = manager.create(PASSING_TASK, "validate")["instance_id"]
        manager.step(instance_id, call("ls"))
        worker = manager._pool._workers[0]
        os.kill(worker.process.pid, signal.SIGSTOP)  # the request waits in the worker's socket, unread
        answers = []
        stepping = threading.Thread(target=lambda: answers.append(manager.step(instance_id, call("pwd"))))
        stepping.start()
        _sent(worker)
        os.kill(worker.process.pid, signal.SIGKILL)  # the OOM killer, say: not this request's doing
        stepping.join(60)
        assert answers and answers[0]["info"]["num_steps"] == 2  # before: 500 episode_lost
        assert manager.evaluate(instance_id)["num_steps"] == 2
    finally:
        manager.close_all()


def _edit_with_unknown_fields() -> str:
    """An ``edit_ticket`` whose error lists the unknown fields in the order of a set of strings (hash order)."""
    return call("edit_ticket", ticket_id=987654, updates={f"field_{k}": "x" for k in range(12)})


def test_replies_that_iterate_sets_are_the_same_bytes_on_every_worker_and_replay_after_a_kill():
    manager = EpisodeManager(workers=2)
    try:
        pool = manager._pool
        first, second = (manager.create(TICKET_TASK, "validate")["instance_id"] for _ in range(2))
        homes = [next(w for w in pool._workers if iid in w.episodes) for iid in (first, second)]
        assert homes[0] is not homes[1]  # placement: the fewest episodes first
        replies = [manager.step(iid, _edit_with_unknown_fields())["message"]["content"] for iid in (first, second)]
        assert "Invalid fields for update" in replies[0]
        assert replies[0].encode() == replies[1].encode()  # before: each worker drew its own hash seed
        generation = homes[0].generation
        os.kill(homes[0].process.pid, signal.SIGKILL)
        assert _replaced(homes[0], generation)
        again = manager.step(first, _edit_with_unknown_fields())  # replayed on the replacement first, then run
        assert again["message"]["content"].encode() == replies[0].encode()
    finally:
        manager.close_all()


# The finds below stop at the call budget, well inside the message budget plus grace (room for a loaded machine):
# slow, but within budget. Four of them cost more than replay_budget_s, the whole replay's budget before.
SLOW = ServiceLimits(
    call_budget_s=0.2, message_budget_s=0.5, worker_grace_s=2.5, call_memory_mib=4096, replay_budget_s=0.5
)


def test_one_owners_slow_episodes_do_not_use_up_another_owners_replay_and_only_the_killer_is_lost():
    manager = EpisodeManager(workers=1, limits=SLOW)
    try:
        worker = manager._pool._workers[0]
        slow = []
        for _ in range(2):  # created first: before, their replay came first and spent the shared budget
            iid = manager.create("multi_turn_base_0", "validate", owner="hostile")["instance_id"]
            for message in [*aliasing_messages(), call("find", path="."), call("find", path=".")]:
                manager.step(iid, message, owner="hostile")
            slow.append(iid)
        task = tasks.load_task("multi_turn_base_1")
        messages = replay.ground_truth_messages(task)
        innocent = manager.create(task.id, "validate", owner="innocent")["instance_id"]
        manager.step(innocent, messages[0], owner="innocent")
        killer = manager.create("multi_turn_base_0", "validate", owner="hostile")["instance_id"]
        outcome = []

        def killing_step():
            try:
                manager.step(killer, call("ls"), owner="hostile")
            except Exception as error:  # noqa: BLE001 - the point: its episode is the one lost
                outcome.append(error)

        os.kill(worker.process.pid, signal.SIGSTOP)  # its next message holds the worker past its deadline
        stepping = threading.Thread(target=killing_step)
        stepping.start()
        _sent(worker)
        stepping.join(60)
        assert outcome and "lost" in str(outcome[0]) and worker.restarts == 1
        for message in messages[1:]:  # before: lost, its replay run after the slow ones' past the shared budget
            manager.step(innocent, message, owner="innocent")
        assert manager.evaluate(innocent, release=True, owner="innocent")["valid"] is True
        for iid in slow:  # the slow episodes are rebuilt too, within budgets of their own
            assert manager.step(iid, call("pwd"), owner="hostile")["info"]["num_steps"] == len(aliasing_messages()) + 3
    finally:
        manager.close_all()


@pytest.fixture()
def descriptors_past_1024():
    """Raise the soft descriptor limit and hold enough descriptors that every new one numbers 1024 or more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard descriptor limit ({hard}) is below {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _thread_cpu_s(name: str) -> float:
    import psutil

    native = next(t.native_id for t in threading.enumerate() if t.name == name)
    times = next(t for t in psutil.Process().threads() if t.id == native)
    return times.user_time + times.system_time


def test_the_monitor_reads_heartbeats_and_sees_exits_past_descriptor_1024_without_spinning(descriptors_past_1024):
    manager = EpisodeManager(workers=1)
    with ServerThread(manager) as server:
        worker = manager._pool._workers[0]
        assert worker.beats.fileno() >= 1024
        cpu_before = _thread_cpu_s("env-heartbeats")
        time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)  # a worker whose beats go unread reads as not answering by now
        assert _thread_cpu_s("env-heartbeats") - cpu_before < 0.1  # before: a busy loop, a whole core
        health = requests.get(server.url + "/health", timeout=10)
        assert health.status_code == 200, health.text  # before: 503 for good
        assert health.json()["workers"]["per_worker"][0]["heartbeat_age_s"] < 1.0
        instance_id = manager.create(PASSING_TASK, "validate")["instance_id"]
        generation = worker.generation
        os.kill(worker.process.pid, signal.SIGKILL)
        assert _replaced(worker, generation)  # its exit seen on a pidfd numbered past 1024 too
        assert manager.step(instance_id, call("ls"))["info"]["num_steps"] == 1
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
