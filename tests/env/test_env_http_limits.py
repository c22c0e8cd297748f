"""HTTP limits of the real service, driven with raw sockets on 127.0.0.1: header bytes and count, read
timeouts for slow clients, and that an attacker's oversized request does not stall an innocent episode; and the
client address per-address limits count against (``peer_key``).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.limits import LOOPBACK_PEER, HttpLimits, peer_key
from env_service.http.service import ServerThread

READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager(), limits=HttpLimits(read_timeout_s=READ_TIMEOUT_S)) as srv:
        yield srv


def connect(server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 10 s pass)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def get(extra_headers: bytes = b"", path: bytes = b"/health") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra_headers + b"\r\n"


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def send_and_read(server, request: bytes) -> bytes:
    with connect(server) as sock:
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before we finished sending: the answer may still be readable
        return read_response(sock)


def test_header_bytes_over_the_limit_get_431_and_under_it_pass(server):
    limit = HttpLimits().max_header_bytes
    ok = send_and_read(server, get(b"X-Pad: " + b"a" * (limit - 1024) + b"\r\n"))
    assert status_of(ok) == 200
    refused = send_and_read(server, get(b"X-Pad: " + b"a" * (limit + 1) + b"\r\n"))
    assert status_of(refused) == 431 and b"headers_too_large" in refused


def test_header_count_over_the_limit_gets_431(server):
    limit = HttpLimits().max_headers
    many = lambda n: b"".join(b"X-H%d: 1\r\n" % i for i in range(n))  # noqa: E731
    assert status_of(send_and_read(server, get(many(limit - 5)))) == 200
    refused = send_and_read(server, get(many(limit + 1)))
    assert status_of(refused) == 431 and b"headers_too_many" in refused


def test_a_64_mb_header_does_not_stall_an_innocent_episode(server):
    client = EnvClient(server.url, retries=0, timeout_s=30)
    instance_id = client.create("multi_turn_base_0", "validate")["instance_id"]
    outcome = {}

    def attacker():
        started = time.monotonic()
        with connect(server) as sock:
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 * 2**20) + b"\r\n\r\n")
                outcome["response"] = read_response(sock)
            except OSError as error:  # the server closed on us mid-send: refused early, as it should
                outcome["response"] = repr(error).encode()
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=attacker)
    thread.start()
    latencies = []
    while thread.is_alive() or not latencies:
        begun = time.monotonic()
        if client.step(instance_id, "still here?")["terminated"]:
            client.release(instance_id)
            instance_id = client.create("multi_turn_base_0", "validate")["instance_id"]
        latencies.append(time.monotonic() - begun)
    thread.join()
    client.release(instance_id)
    assert (
        b"431" in outcome["response"]
        or b"Connection reset" in outcome["response"]
        or b"Broken pipe" in outcome["response"]
    ), outcome["response"][:200]
    # Unbounded, the server buffered and parsed all 64 MB on its event loop (~9 s, requests stalled ~3.5 s).
    assert outcome["seconds"] < 3.0, outcome
    assert max(latencies) < 1.0, latencies


def test_a_slow_client_is_timed_out_with_408(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        started = time.monotonic()
        response = read_response(sock)
    assert status_of(response) == 408 and b"request_timeout" in response
    assert READ_TIMEOUT_S * 0.5 < time.monotonic() - started < READ_TIMEOUT_S + 5


def test_a_silent_connection_is_closed(server):
    with connect(server) as sock:
        started = time.monotonic()
        response = read_response(sock)
    assert status_of(response) == 408
    assert time.monotonic() - started < READ_TIMEOUT_S + 5


def test_a_body_that_never_finishes_is_dropped(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"instance_id": '
        )
        started = time.monotonic()
        read_response(sock)  # returns once the server closes
    assert time.monotonic() - started < READ_TIMEOUT_S + 5


def test_kept_alive_connections_survive_pauses_between_requests(server):
    """The read timeout applies to a request in progress, not to the idle time between requests."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server) as sock:
        for _ in range(2):
            sock.sendall(request)
            head = sock.recv(65536)
            assert status_of(head) == 200
            time.sleep(READ_TIMEOUT_S * 1.5)


def test_websocket_upgrades_are_plain_requests_and_hold_no_connection_slot():
    limits = HttpLimits(max_connections=120, max_connections_per_peer=5)
    upgrade = get(
        b"Upgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n",
        path=b"/ws",
    ).replace(b"Connection: close", b"Connection: Upgrade")
    with ServerThread(EpisodeManager(), limits=limits) as server:
        for _ in range(2 * limits.max_connections_per_peer):  # ours: each one used to keep its slot for good
            with connect(server) as sock:
                sock.sendall(upgrade)
                assert status_of(sock.recv(65536)) == 404  # before: 403 from uvicorn's WebSocket protocol
        assert status_of(send_and_read(server, get())) == 200  # before: 503 too_many_connections


def test_server_healthy_after_the_abuse(server):
    assert server.alive()
    assert EnvClient(server.url, retries=0).health()["status"] == "ok"


@pytest.mark.parametrize(
    "host, key",
    [
        ("127.0.0.1", LOOPBACK_PEER),  # any process here may bind any loopback address: one client
        ("127.0.0.2", LOOPBACK_PEER),
        ("127.255.255.254", LOOPBACK_PEER),
        ("::1", LOOPBACK_PEER),
        ("::ffff:127.0.0.1", LOOPBACK_PEER),  # IPv4-mapped loopback
        ("::ffff:127.9.8.7", LOOPBACK_PEER),
        ("::ffff:10.1.2.3", "10.1.2.3"),  # IPv4-mapped: its IPv4 address
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),  # one host holds a whole /64
        ("2001:db8:1:2::ffff", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),  # a zone id does not make another client
        ("10.0.0.1", "10.0.0.1"),
        ("192.0.2.7", "192.0.2.7"),
        ("?", "?"),  # no address (uvicorn gives none): kept as given
        ("not-an-address", "not-an-address"),
    ],
)
def test_peer_key_is_one_key_per_client_that_controls_the_addresses(host, key):
    assert peer_key(host) == key


def test_a_service_for_a_trainer_holds_its_peak_episodes_and_an_explicit_limit_wins():
    """``serve --peak-episodes N`` (the launcher passes the recipe's): one client's requests in flight and connections
    hold 2 requests of each of its N episodes, never below the defaults; a limit given explicitly stays as given, and
    one below N is named with both numbers."""
    assert HttpLimits.serving() == HttpLimits() == HttpLimits.serving(None)
    assert HttpLimits.serving(20) == HttpLimits()  # 40 requests fit every default
    recipe = HttpLimits.serving(400)  # exp/SEAL.yaml's validation batch
    assert (recipe.max_requests_per_owner, recipe.max_connections_per_peer, recipe.max_connections) == (800, 1024, 2048)
    doubled = HttpLimits.serving(1200)
    assert (doubled.max_requests_per_owner, doubled.max_connections_per_peer, doubled.max_connections) == (2400,) * 3
    assert recipe.shortfalls(400) == [] and HttpLimits().shortfalls(96) == []
    capped = HttpLimits.serving(400, max_requests_per_owner=100)
    assert capped.max_requests_per_owner == 100
    assert capped.shortfalls(400) == [
        "max_requests_per_owner is 100, below the 400 episodes the trainer runs at once (one request each in flight; "
        "800 leaves room for retries)"
    ]
    with pytest.raises(ValueError, match="peak_episodes must be at least 1"):
        HttpLimits.serving(0)
