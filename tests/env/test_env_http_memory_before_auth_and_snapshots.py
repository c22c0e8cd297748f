"""The real service's HTTP limits on 127.0.0.1: pipelined requests and request bodies in flight cost
bounded memory before anyone is authenticated (the service's own RSS is measured: the server runs in this
process), and malformed OOD memory snapshots are the client's error (4xx with one line), never a 500.
"""

from __future__ import annotations

import json
import select
import socket
import time

import pytest
import requests

from env_service.bfcl.ood_tasks import ood_task_ids
from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.limits import BytesInFlight, HttpLimits
from env_service.http.service import ServerThread

LIMITS = HttpLimits()  # the defaults: what a service started without flags has


@pytest.fixture(scope="module")
def service():
    with ServerThread(EpisodeManager()) as server:  # episodes in this process: starts in a second
        yield server


def _rss_mib() -> float:
    """This process's resident memory: the service's, as the server runs in a thread here."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _peak_growth_mib(seconds: float, before: float) -> float:
    peak = before
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, _rss_mib())
        time.sleep(0.05)
    return peak - before


def _send_until_stalled(sock: socket.socket, data: bytes) -> int:
    """Send ``data`` without reading; stop where the server stops reading (the send stalls). Bytes sent."""
    sock.settimeout(1.0)
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(data[sent : sent + 65536])
    except (TimeoutError, OSError):
        pass  # stalled (the server reads no more) or closed by the server
    return sent


# ---------------------------------------------------------------------------------------------
# Item 1: pipelined requests
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret_service():
    with ServerThread(EpisodeManager(), secret="s3cret") as server:
        yield server


@pytest.mark.parametrize(
    "which, request_bytes",
    [
        ("service", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"),
        # unauthenticated: refused by the secret, each one still a request in flight
        ("secret_service", b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"),
    ],
)
def test_pipelining_megabytes_of_requests_costs_the_service_little(request, which, request_bytes):
    server = request.getfixturevalue(which)
    before = _rss_mib()
    with socket.create_connection((server.host, server.port)) as sock:
        _send_until_stalled(sock, request_bytes * (2 * 2**20 // len(request_bytes)))  # ~60 k requests, never read
        grown = _peak_growth_mib(2.0, before)
    # Before: every request was parsed into one in flight at once, ~800 bytes each (+20 to +50 MiB here in 2 s)
    assert grown < 8, f"the service grew by {grown:.0f} MiB"


def test_a_pipelining_connection_that_never_reads_its_answers_is_closed():
    """Busy is no shelter: its answers stall (never read), so its held-back requests are never parsed, and the read
    timeout closes it. Before, a connection with a request in flight had no read timeout at all."""
    limits = HttpLimits(read_timeout_s=1.0)
    with ServerThread(EpisodeManager(), limits=limits) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # answers pile up in the service's buffers
        sock.connect((server.host, server.port))
        with sock:
            _send_until_stalled(sock, b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 4000)
            poll = select.poll()
            poll.register(sock, select.POLLRDHUP)
            assert poll.poll(15_000), "the connection is still open"


@pytest.mark.parametrize("piece_bytes", [None, 3, 7])  # all at once; pieces that split every request's headers' end
def test_pipelined_requests_are_all_answered_in_order(service, piece_bytes):
    body = b'{"instance_id": "ep_none"}'
    requests_ = [
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /release HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body),
        b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n",
    ] * (3 * LIMITS.max_pipelined_requests)
    expected = [200, 200, 404] * (3 * LIMITS.max_pipelined_requests)
    with socket.create_connection((service.host, service.port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = b"".join(requests_)
        for start in range(0, len(sent), piece_bytes or len(sent)):
            sock.sendall(sent[start : start + (piece_bytes or len(sent))])
        reader = sock.makefile("rb")
        statuses = []
        for _ in expected:
            statuses.append(int(reader.readline().split()[1]))
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            reader.read(length)
    assert statuses == expected


# ---------------------------------------------------------------------------------------------
# Item 2: request bodies in flight, all connections together
# ---------------------------------------------------------------------------------------------


def test_bodies_in_flight_share_one_budget_and_an_innocent_is_served(service):
    body_bytes = LIMITS.max_body_bytes
    head = (
        b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % body_bytes
    )
    almost = head + b" " * (body_bytes - 1)  # all but the last byte: the body never completes
    innocent = EnvClient(service.url, timeout_s=30)
    before = _rss_mib()
    attackers, innocent_ok = [], []
    for k in range(128):  # 256 MiB of bodies in flight, were they all kept
        sock = socket.create_connection((service.host, service.port))
        _send_until_stalled(sock, almost)
        attackers.append(sock)
        if k % 32 == 31:
            innocent_ok.append(innocent.health()["status"] == "ok")
    grown = _peak_growth_mib(1.0, before)
    budget_mib = LIMITS.max_body_bytes_in_flight / 2**20
    kept = budget_mib // (body_bytes / 2**20)  # bodies the budget holds at once
    deadline, shed = time.monotonic() + 10, set()
    while len(shed) < len(attackers) - kept and time.monotonic() < deadline:  # the server may still be reading
        grown = max(grown, _rss_mib() - before)
        shed |= {k for k, sock in enumerate(attackers) if k not in shed and _closed_by_server(sock)}
        time.sleep(0.1)
    for sock in attackers:
        sock.close()
    innocent.close()
    # Before: every body was buffered (+259 MiB here); now what bodies hold is the budget (64 MiB by default).
    assert grown < 1.5 * budget_mib, f"the service grew by {grown:.0f} MiB"
    assert len(shed) >= len(attackers) - kept, sorted(shed)  # the longest waiting were closed to make room
    assert min(set(range(len(attackers))) - shed) >= len(attackers) - kept - 1  # the newest ones are kept
    assert all(innocent_ok)


def _closed_by_server(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Holder:
    """A connection as ``BytesInFlight`` sees it."""

    def __init__(self, waits: bool):
        self.waits, self.shed_because = waits, None

    def waits_on_client(self) -> bool:
        return self.waits

    def shed(self, why: str) -> None:
        self.shed_because = why


def test_the_budget_sheds_waiting_holdings_longest_first_and_never_a_request_in_processing():
    budget = BytesInFlight(100)
    processing, oldest_waiting, newer_waiting = _Holder(False), _Holder(True), _Holder(True)
    assert budget.admit(processing, 40) and budget.admit(oldest_waiting, 30) and budget.admit(newer_waiting, 30)
    newcomer = _Holder(False)
    assert budget.admit(newcomer, 20) and budget.total == 90  # room made by the longest waiting alone
    assert oldest_waiting.shed_because and not newer_waiting.shed_because and not processing.shed_because
    assert not budget.admit(_Holder(False), 90)  # after shedding newer_waiting still no room: refused
    assert newer_waiting.shed_because and not processing.shed_because
    budget.release(processing, 40)
    budget.release(newcomer)
    assert budget.total == 0


def test_a_chunked_request_body_is_refused_with_411(service):
    with socket.create_connection((service.host, service.port), timeout=10) as sock:
        sock.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 411 ")


# ---------------------------------------------------------------------------------------------
# Item 10: memory snapshots
# ---------------------------------------------------------------------------------------------


def _create(server, task_id: str, snapshot_json: str) -> requests.Response:
    body = f'{{"task_id": {json.dumps(task_id)}, "mode": "validate", "memory_snapshot": {snapshot_json}}}'
    return requests.post(f"{server.url}/create", data=body, headers={"content-type": "application/json"}, timeout=60)


def _nested(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


@pytest.mark.parametrize(
    "category, snapshot",
    [
        ("memory_kv", '{"core_memory": {}}'),  # a key missing
        ("memory_kv", '{"memory": "x"}'),  # another backend's snapshot
        ("memory_kv", '{"core_memory": [], "archival_memory": {}}'),  # a memory that is not an object
        ("memory_kv", '{"core_memory": {"k": 1}, "archival_memory": {}}'),  # an entry that is not text
        ("memory_kv", f'{{"core_memory": {{"k": {_nested(900)}}}, "archival_memory": {{}}}}'),  # deep: no recursion
        ("memory_rec_sum", '{"memory": 5}'),
        ("memory_rec_sum", '{"memory": null}'),
        ("memory_rec_sum", '{"memory": ["a"]}'),
        ("memory_rec_sum", '{"memory": "ok", "extra": 1}'),
        ("memory_rec_sum", f'{{"memory": {_nested(200)}}}'),
    ],
)
def test_malformed_memory_snapshots_are_refused_with_one_line(service, category, snapshot):
    question = ood_task_ids(category)[0]  # a question loads the snapshot it is given
    response = _create(service, question, snapshot)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    detail = response.json()["detail"]
    assert "memory_snapshot" in detail and "\n" not in detail and len(detail) < 300, detail


def test_well_formed_and_empty_snapshots_are_taken(service):
    for category, snapshot in [
        ("memory_kv", '{"core_memory": {"name": "Ada"}, "archival_memory": {"pet": "a cat"}}'),
        ("memory_rec_sum", '{"memory": "Ada has a cat."}'),
        ("memory_rec_sum", "{}"),  # bfcl's "no memory yet"
    ]:
        response = _create(service, ood_task_ids(category)[0], snapshot)
        assert response.status_code == 200, response.text[:300]
        instance_id = response.json()["instance_id"]
        assert "Ada" in response.json()["messages"][0]["content"] or snapshot == "{}"
        requests.post(f"{service.url}/release", json={"instance_id": instance_id}, timeout=60)
