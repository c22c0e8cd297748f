"""The real service on 127.0.0.1 (a real uvicorn server, real worker processes where the hole is theirs):
requests whose client is gone, answers that are never read, and header abuse before authentication."""

from __future__ import annotations

import json
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.limits import HttpLimits
from env_service.http.service import ServerThread
from tests.support.env_attacks import BENCHMARK, aliasing_messages
from tests.support.env_attacks import call as _call

FS_TASK = "multi_turn_base_0"  # GorillaFileSystem: directory aliasing makes find run to its budget


def _raw_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


# ---------------------------------------------------------------------------------------------
# Hole 3: abandoned requests
# ---------------------------------------------------------------------------------------------


def test_a_create_whose_client_disconnects_frees_its_slot_and_leaves_no_episode():
    """The create waits for the one worker (busy with a message that runs to its budget); its client disconnects.
    Before: it kept its place among the client's requests in flight until it had run (the client's next request got
    429), and the episode it made lived, for no one, until the idle reclaim."""
    limits = ServiceLimits(message_budget_s=1.0, call_budget_s=1.0)
    with ServerThread(EpisodeManager(workers=1, limits=limits), limits=HttpLimits(max_requests_per_owner=2)) as server:
        client = EnvClient(server.url, retries=0, timeout_s=60)
        busy = client.create(FS_TASK, "validate")["instance_id"]
        for message in aliasing_messages():  # after these, each find runs to its budget
            client.step(busy, message)
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(client.step, busy, _call("find", path="."))  # 1 of the 2 requests in flight
            time.sleep(0.2)
            with socket.create_connection((server.host, server.port)) as sock:  # 2 of 2
                sock.sendall(_raw_post("/create", {"task_id": FS_TASK, "mode": "validate"}))
                time.sleep(0.2)  # it waits for the worker
            time.sleep(0.1)
            assert requests.get(server.url + "/profile", timeout=10).status_code == 200  # its slot is free
            assert slow.result()["info"]["error_type"] == "budget_exceeded"  # the worker was busy all along
        deadline = time.monotonic() + 5
        while (health := requests.get(server.url + "/health", timeout=10).json())["live"] != 1:
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert health["created"] == 1, health  # dropped before it started: no episode was made for no one
        client.release(busy)
        client.close()


# ---------------------------------------------------------------------------------------------
# Hole 2: answers that are never read
# ---------------------------------------------------------------------------------------------

PROFILE = {"notes": "x" * (900 * 1024)}  # GET /profile answers it: a cheap request with a ~900 KB answer


def _never_reading(server) -> socket.socket:
    """A connection whose client asks for the big answer and never reads it (a small receive buffer: what is not
    taken stays with the service)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    sock.sendall(b"GET /profile HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


def _reset_by_server(sock: socket.socket, within_s: float) -> bool:
    poll = select.poll()
    poll.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poll.poll(int(within_s * 1000)))


def test_an_answer_never_read_is_dropped_with_its_connection_after_the_write_timeout():
    """Before: the connection and its answer stayed (a kept-alive connection whose write buffer never drains is never
    closed), and a second request on it waited for good, holding its place among the client's requests in flight."""
    with ServerThread(EpisodeManager(), limits=HttpLimits(write_timeout_s=1.0)) as server:
        requests.post(server.url + "/profile", json={"profile": PROFILE}, timeout=30).raise_for_status()
        with _never_reading(server) as sock:
            sock.sendall(b"GET /profile HTTP/1.1\r\nHost: x\r\n\r\n")  # and one more behind it
            started = time.monotonic()
            assert _reset_by_server(sock, within_s=10), "the connection is still open"
            assert time.monotonic() - started < 4
        assert requests.get(server.url + "/health", timeout=10).json()["status"] == "ok"


def test_answers_held_for_clients_that_never_read_share_one_budget():
    budget = 4 * 2**20
    limits = HttpLimits(max_answer_bytes_in_flight=budget, write_timeout_s=60.0)
    with ServerThread(EpisodeManager(), limits=limits) as server:
        requests.post(server.url + "/profile", json={"profile": PROFILE}, timeout=30).raise_for_status()
        socks = []
        for _ in range(24):  # ~21 MiB of answers, were they all kept
            socks.append(_never_reading(server))
            time.sleep(0.05)  # answered in order: the longest holding are the first ones
        time.sleep(2.5)  # two sweeps: a connection is dropped for room once its client took nothing between them
        dropped = [k for k, sock in enumerate(socks) if _reset_by_server(sock, within_s=0.01)]
        kept = budget // len(json.dumps({"profile": PROFILE})) + 1
        assert len(dropped) >= len(socks) - kept, dropped  # before: none
        assert set(range(len(socks) - kept + 1, len(socks))).isdisjoint(dropped)  # the newest ones are kept
        with EnvClient(server.url, retries=0, timeout_s=10) as innocent:  # who reads its answers is served
            assert innocent.get_profile()["profile"] == PROFILE
        for sock in socks:
            sock.close()


# ---------------------------------------------------------------------------------------------
# New class: header abuse before authentication (request smuggling, parser cost)
# ---------------------------------------------------------------------------------------------

SECRET = "s3cret"


def test_header_abuse_is_refused_before_anything_reads_the_request():
    """One 4xx per abuse, then the connection closes: no request is read with another boundary or another identity
    than the one a second reader would see. llhttp refuses most of them itself (checked here, through the real
    server, so that an upgrade that relaxes it fails this test); the service refuses a second copy of any header that
    says who sends a request or for which run (before: the first one won, unseen by anything reading the last)."""
    with ServerThread(EpisodeManager(), secret=SECRET) as server:
        abuse = BENCHMARK.header_abuse(SECRET)  # the benchmark floods the service with these
        refusals = {name: BENCHMARK.status_lines(server.host, server.port, data) for name, data in abuse.items()}
        with EnvClient(server.url, secret=SECRET, retries=0) as client:
            assert client.get_profile()["version"] == 0  # the smuggled request never ran
    wrong = {
        name: answers
        for name, answers in refusals.items()
        if len(answers) != 1 or not answers[0].split()[1].startswith(b"4")
    }
    assert not wrong, wrong
