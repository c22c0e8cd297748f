"""Clients gone mid-create, answers never read, and an episode moved off a worker busy with another's long message,
each through the served process (``python -m env_service serve``, started by the env benchmark's
``ServiceProcess``) and real HTTP connections."""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from env_service.client import EnvClient
from tests.support.processes import repo_script, wait_for

BENCH = repo_script("benchmarks/env_service.py")
TASK = "multi_turn_base_2"
OOD_TASK = "memory_kv_prereq_32-notetaker-0"  # an OOD episode with a scratch folder


def _raw_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def _health(service) -> dict:
    return requests.get(service.url + "/health", timeout=30).json()


EPISODE_CAP = 16
WRITE_TIMEOUT_S = 3  # --write-timeout-s for the tests (default 30): the same sweep, ten times sooner


@pytest.fixture(scope="module")
def service():
    """One served process for the module (a start loads the task table in every worker: seconds)."""
    flags = ("--workers", "1", "--max-episodes-per-owner", str(EPISODE_CAP), "--write-timeout-s", str(WRITE_TIMEOUT_S))
    with BENCH.ServiceProcess(*flags) as served:
        yield served


# ---------------------------------------------------------------------------------------------
# A client gone in the middle of create
# ---------------------------------------------------------------------------------------------

GONE_CREATES = 64


def _create_and_leave(port: int, k: int) -> None:
    """A create whose client leaves before reading its answer: at once, or once the answer has arrived unread (its
    kernel then resets the connection); closed with a FIN or reset (``SO_LINGER`` 0), in turn."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(_raw_post("/create", {"task_id": TASK, "mode": "validate"}))
    if k % 4 >= 2:  # the answer is there, unread: the service wrote it, and its client never takes it
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        poll.poll(30_000)
    if k % 2:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_creates_whose_client_leaves_before_reading_the_answer_leave_no_episode_and_free_every_slot(service):
    """Before: an episode whose answer had been written when its client left lived on, for no one, until the idle
    reclaim (600 s) and held one of its client's slots (the red team's client got 3 of its 16)."""
    abandoned_before = _health(service)["abandoned"]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: _create_and_leave(service.port, k), range(GONE_CREATES)))
    health = wait_for(lambda: (h := _health(service))["live"] == 0 and h, 10, "episodes made for no one live on")
    assert health["abandoned"] > abandoned_before, health  # made, and released when their answers were not taken
    with EnvClient(service.url, retries=0, timeout_s=60) as client:  # the client gets every one of its slots
        made = [client.create(TASK, "validate")["instance_id"] for _ in range(EPISODE_CAP)]
        for iid in made:
            client.release(iid)


# ---------------------------------------------------------------------------------------------
# Answers never read
# ---------------------------------------------------------------------------------------------

UNREAD_ANSWERS = 160
ANSWER_BUDGET_MIB = 64  # --max-answer-bytes-in-flight's default
#: What the service's RSS may grow by beyond the budget: what serving 160 answers costs whether or not they are read
#: (the allocator's high water of rendering them).
RSS_SLACK_MIB = 32
#: A memory of many short entries (~0.9 MB of JSON): a prerequisite evaluated with it keeps its verdict for retries, so
#: each retried evaluate is a cheap request with a ~1 MiB answer.
MEMORY = {"core_memory": {}, "archival_memory": {f"k{i}": f"note {i}" for i in range(40_000)}}
MEMORY_PREREQ = "memory_kv_prereq_33-notetaker-1"


def _big_answer_requests(service) -> list[bytes]:
    """Requests of two kinds each answered with ~1 MiB: ``GET /profile`` of a big profile, and a retried ``evaluate``
    of a released memory prerequisite (its kept verdict carries the memory)."""
    with EnvClient(service.url, retries=0, timeout_s=120) as client:
        client.set_profile({"notes": "x" * (900 * 1024)})
        iid = client.create(MEMORY_PREREQ, "validate", memory_snapshot=MEMORY)["instance_id"]
        assert len(json.dumps(client.evaluate(iid, release=True))) > 900_000
    return [b"GET /profile HTTP/1.1\r\nHost: x\r\n\r\n", _raw_post("/evaluate", {"instance_id": iid, "release": True})]


def _never_reading(port: int, request: bytes, k: int) -> socket.socket:
    """A connection that asks ``request`` and never reads its answer: it keeps it open; or, once the answer began
    to arrive, closes its side (FIN); or asks the service to close it after the answer (``Connection: close``)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # what it does not take stays with the service
    sock.connect(("127.0.0.1", port))
    if k % 3 == 2:
        request = request.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n", 1)
    sock.sendall(request)
    if k % 3 == 1:
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        poll.poll(30_000)
        sock.shutdown(socket.SHUT_WR)
    return sock


def _service_side(port: int) -> tuple[int, int]:
    """(the service's TCP sockets of ``port`` that are not listening or gone, bytes in their send queues): read from
    ``/proc/net/tcp``, so orphans (closed by the service, its answer still queued in the kernel) count too."""
    sockets = queued = 0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] not in ("0A", "06", "07"):  # LISTEN, TIME_WAIT, CLOSE
            sockets += 1
            queued += int(fields[4].split(":")[0], 16)
    return sockets, queued


def test_answers_never_read_stay_within_their_budget_and_their_connections_close_after_the_write_timeout(service):
    """Before: connections whose client closed its side after the answer began, or that asked for ``Connection:
    close``, were out of both limits (a closing connection counted as holding nothing): 160 of them held ~120 MiB of
    send queues, every one still there 35 s later."""
    asks = _big_answer_requests(service)
    time.sleep(1.0)  # what the set-up's own answers left is settled
    rss_before, (sockets_before, _) = service.rss_mib(workers=False), _service_side(service.port)
    socks = [_never_reading(service.port, asks[k % 2], k) for k in range(UNREAD_ANSWERS)]
    peak = 0.0
    last_sent = time.monotonic()
    while time.monotonic() < last_sent + WRITE_TIMEOUT_S + 4:  # the timeout, and sweeps (each within a second)
        sockets, queued = _service_side(service.port)
        peak = max(peak, queued / 2**20 + service.rss_mib(workers=False) - rss_before)
        time.sleep(0.1)
    assert peak <= ANSWER_BUDGET_MIB + RSS_SLACK_MIB, f"answers held {peak:.0f} MiB"
    assert sockets <= sockets_before, f"{sockets - sockets_before} connections past the write timeout"
    for sock in socks:
        sock.close()
    assert _health(service)["status"] == "ok"


# ---------------------------------------------------------------------------------------------
# One episode's long message on a worker another client's episode shares
# ---------------------------------------------------------------------------------------------

LONG_MESSAGE_S = 4.0  # the served process's message (and call) budget: the attacker's find runs into it
#: What an innocent step behind the long message may take: the wait before it moves (--move-after-s, 0.25 s) and its
#: replay on the calm worker, with room for a loaded 2-core machine. Before, it waited out the message (~3.5 s).
INNOCENT_STEP_S = 1.5


@pytest.fixture
def two_workers():
    flags = ("--workers", "2", "--message-budget-s", str(LONG_MESSAGE_S), "--call-budget-s", str(LONG_MESSAGE_S))
    flags += ("--call-memory-mib", "4096")  # the find runs into its time budget, not its memory budget
    with BENCH.ServiceProcess(*flags) as served:
        yield served


def _landing_on(worker: int, make, release) -> str:
    """An episode made (``make()``: its id and the worker it landed on) until one lands on ``worker``; the others are
    released. The service places a new episode on the calm worker with the fewest episodes, so the second of two
    innocent episodes shares the attacker's."""
    others = []
    try:
        for _ in range(4):
            iid, placed = make()
            if placed == worker:
                return iid
            others.append(iid)
        raise AssertionError(f"no create landed on worker {worker}")
    finally:
        for iid in others:
            release(iid)


def test_an_episode_behind_another_clients_long_message_moves_to_a_calm_worker_and_answers_as_before(two_workers):
    """Before: an innocent step on the worker of an episode whose every message ran ~4 s (each under its budget)
    waited out the message running when it arrived (the red team's p99: 9 ms alone, 3.4 s beside it). Now the waiting
    episode is replayed on a calm worker and its step served there; the long message runs to its end unharmed."""
    from env_service import replay
    from env_service.bfcl import tasks

    service = two_workers
    messages = replay.ground_truth_messages(tasks.load_task(TASK))
    with (
        EnvClient(service.url, retries=0, timeout_s=120, run_id="attacker") as attacker,
        EnvClient(service.url, retries=0, timeout_s=120, run_id="innocent") as innocent,
    ):
        hostile, heavy_worker = BENCH._placed_on(
            service, lambda: attacker.create("multi_turn_base_0", "validate")["instance_id"], attacker.release
        )
        for message in BENCH.aliasing_messages():
            attacker.step(hostile, message)
        create = lambda: innocent.create(TASK, "validate")["instance_id"]  # noqa: E731
        iid = _landing_on(heavy_worker, lambda: BENCH._placed_on(service, create, innocent.release), innocent.release)
        first = innocent.step(iid, messages[0])["message"]  # a reply from the episode where it was created
        with ThreadPoolExecutor(1) as pool:
            long_message = pool.submit(attacker.step, hostile, BENCH._call("find", path="."))
            wait_for(lambda: service.workers()[heavy_worker]["busy_s"] > 0.3, 10, "the long message never started")
            started = time.monotonic()
            second = innocent.step(iid, messages[1])
            waited, overtaken = time.monotonic() - started, not long_message.done()
            reply = long_message.result()
        assert waited < INNOCENT_STEP_S, f"the innocent step waited {waited:.2f} s behind the long message"
        assert overtaken, "the long message ended before the innocent step was answered: nothing was measured"
        assert not reply["terminated"]  # the long message ran into its budget, as alone: not cut short, not lost
        for message in messages[2:]:
            innocent.step(iid, message)
        assert innocent.evaluate(iid, release=True)["valid"]  # the moved episode is the one it was
        control = innocent.create(TASK, "validate")["instance_id"]
        assert [innocent.step(control, m)["message"] for m in messages[:2]] == [first, second["message"]]
        innocent.release(control)
        attacker.release(hostile)
    assert sum(w["restarts"] for w in service.workers()) == 0


def _holder(manager, iid: str) -> int:
    (index,) = [w.index for w in manager._pool._workers if iid in w.episodes]
    return index


def test_a_heavy_episode_stays_behind_a_long_message_and_a_moved_episodes_copy_is_closed_before_its_old_worker_serves():
    """What a move may cost: an episode whose replay would take longer than the wait it escapes (its own messages ran
    for seconds) waits its turn instead of moving its cost onto the calm worker; and the copy a moved episode leaves
    (here an OOD episode's scratch folder) is closed before the worker it left serves the next request."""
    from env_service.bfcl.config import ServiceLimits
    from env_service.episodes.manager import EpisodeManager
    from tests.support.env_attacks import aliasing_messages, call

    limits = ServiceLimits(message_budget_s=2.0, call_budget_s=2.0, call_memory_mib=4096)
    manager = EpisodeManager(workers=2, limits=limits)
    try:
        hostile = lambda: manager.create("multi_turn_base_0", "validate", owner="hostile")["instance_id"]  # noqa: E731
        release = lambda iid: manager.release(iid)  # noqa: E731
        long_one = hostile()
        worker = _holder(manager, long_one)
        placed = lambda create: lambda: (iid := create(), _holder(manager, iid))  # noqa: E731
        heavy = _landing_on(worker, placed(hostile), release)
        ood = _landing_on(
            worker, placed(lambda: manager.create(OOD_TASK, "validate", owner="innocent")["instance_id"]), release
        )
        scratch = manager._pool._workers[worker].scratch
        assert os.listdir(scratch), "the OOD episode made no scratch folder: nothing to see closed"
        for iid in (long_one, heavy):
            for message in aliasing_messages():
                manager.step(iid, message, owner="hostile")
        for _ in range(2):  # its own cost: two budgets, twice what the long message below runs
            manager.step(heavy, call("find", path="."), owner="hostile")
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(manager.step, long_one, call("find", path="."), owner="hostile")
            wait_for(
                lambda: (manager._pool._workers[worker].busy_since or time.monotonic()) < time.monotonic() - 0.3,
                10,
                "the long message never started",
            )
            waiting = pool.submit(manager.step, heavy, call("pwd"), owner="hostile")
            manager.step(ood, "Done.", owner="innocent")
            assert _holder(manager, ood) != worker and not running.done()  # moved, and served while the message ran
            running.result(), waiting.result()
        assert _holder(manager, heavy) == worker  # served after the long message, where it was
        assert not os.listdir(scratch), "the moved episode's copy was not closed before its old worker served again"
        assert manager._pool.health()["episodes_moved"] == 1
    finally:
        manager.close_all()
