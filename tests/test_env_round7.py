"""Round 7 of the environment service's holes (issue 41), each through the served process (``python -m env_service
serve``, started by the env benchmark's ``ServiceProcess``) and real HTTP connections."""

from __future__ import annotations

import json
import select
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from processes import repo_script, wait_for

from env_service.client import EnvClient

BENCH = repo_script("benchmarks/env_service.py")
TASK = "multi_turn_base_2"


def _raw_post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def _health(service) -> dict:
    return requests.get(service.url + "/health", timeout=30).json()


# ---------------------------------------------------------------------------------------------
# A client gone in the middle of create
# ---------------------------------------------------------------------------------------------

EPISODE_CAP = 16
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


def test_creates_whose_client_leaves_before_reading_the_answer_leave_no_episode_and_free_every_slot():
    """Before: an episode whose answer had been written when its client left lived on, for no one, until the idle
    reclaim (600 s) and held one of its client's slots (the red team's client got 3 of its 16)."""
    flags = ("--workers", "1", "--max-episodes-per-owner", str(EPISODE_CAP))
    with BENCH.ServiceProcess(*flags) as service:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: _create_and_leave(service.port, k), range(GONE_CREATES)))
        health = wait_for(lambda: (h := _health(service))["live"] == 0 and h, 10, "episodes made for no one live on")
        assert health["abandoned"] > 0, health  # made, and released when their answers were not taken
        with EnvClient(service.url, retries=0, timeout_s=60) as client:  # the client gets every one of its slots
            made = [client.create(TASK, "validate")["instance_id"] for _ in range(EPISODE_CAP)]
            for iid in made:
                client.release(iid)
