"""Hostile model text and other clients against a real service (loopback HTTP, one worker process): whatever a policy
writes, or another client on the machine sends, costs only the sender.

* model text shaped to exhaust a parser's depth is an error text the model reads, not a 500;
* every reply, parse-error replies included, stays within ``max_reply_bytes`` and reports a few errors;
* instance ids are minted by the service; nothing kept for one episode answers for another, and another
  run (or another client address) cannot touch an episode;
* what an episode keeps between messages has a budget: over it the episode ends with a text, a flood of
  refused calls keeps next to nothing, and the worker does not grow with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from env_service import replay
from env_service.bfcl import tasks
from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient, EnvServiceError
from env_service.episodes.manager import MAX_RUN_PROFILES, EpisodeManager
from env_service.http.auth import RUN_ID_HEADER
from env_service.http.limits import HttpLimits
from env_service.http.service import ServerThread
from env_service.workers.pool import HEARTBEAT_TIMEOUT_S
from tests.support.env_attacks import aliasing_messages, episodes_on_two_workers, worker_of
from tests.support.env_attacks import call as _call

LIMITS = ServiceLimits(
    call_budget_s=1.0,
    message_budget_s=1.5,
    max_reply_bytes=4096,
    max_errors_per_message=5,
    max_episode_bytes=1024 * 1024,
    max_steps=80,
)
HTTP = HttpLimits(max_requests_per_owner=8)
TASK = "multi_turn_base_2"
FS_TASK = "multi_turn_base_0"  # GorillaFileSystem: directory aliasing makes find exponential
LENIENT = {"enforce_available_tools": False}


def tool_call(name, arguments=None) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments or {}}) + "</tool_call>"


@pytest.fixture(scope="module")
def service():
    with ServerThread(EpisodeManager(workers=2, limits=LIMITS), limits=HTTP) as server:
        yield server


@pytest.fixture()
def client(service):
    with EnvClient(service.url, retries=0, timeout_s=60) as c:
        yield c


def _passes(client, instance_id: str) -> dict:
    for message in replay.ground_truth_messages(tasks.load_task(TASK)):
        client.step(instance_id, message)
    return client.evaluate(instance_id)


# -- class 4: exceptions from model text ------------------------------------------------------------

DEEP_NAMES = [
    "a." * 5000 + "a",  # the three
    "a+" * 5000 + "a",
    "a" + "()" * 5000,
    "-" * 20000 + "a",  # ours: unary chains, subscripts, boolean and conditional chains, lambdas
    "a[" * 3000 + "0" + "]" * 3000,
    "not " * 5000 + "a",
    "a if a else " * 3000 + "a",
    "lambda: " * 3000 + "a",
    "a." * 900 + "a",  # short enough to parse, deep enough for a recursive walk of the tree
]


def test_deeply_nested_names_are_error_texts_and_the_episode_goes_on(client):
    instance_id = client.create(TASK, "validate", LENIENT)["instance_id"]
    for name in DEEP_NAMES:
        reply = client.step(instance_id, tool_call(name))  # raised 500 episode_failure before
        assert "Error during execution" in reply["message"]["content"], name[:20]
        assert reply["info"]["num_tool_errors"] == 1
    python_mode = client.create(TASK, "validate", {**LENIENT, "tool_prompt_mode": "toolace_llama"})["instance_id"]
    reply = client.step(python_mode, "[" + "a." * 900 + "a(x=1)]")
    assert reply["terminated"] is False
    evaluation = client.evaluate(instance_id, release=True)  # the verifier replays the same calls
    assert evaluation["valid"] is False and evaluation["num_steps"] == len(DEEP_NAMES)
    client.release(python_mode)


# -- class 3: every reply path clipped ----------------------------------------------------------------

FLOODS = [
    ("bfcl_qwen_fc", "<tool_call>{bad}</tool_call>" * 9000),  # the issue's: invalid JSON per block
    ("bfcl_qwen_fc", '<tool_call>{"name": "x"}</tool_call>' * 6000),  # ours: missing keys per block
    ("bfcl_qwen_fc", '<tool_call>{"name": "ls", "arguments": "[1]"}</tool_call>' * 4000),  # ours: not objects
    ("toolace_llama", "[" + ", ".join(["f(1)"] * 2000) + "]"),  # positional arguments per call
]


@pytest.mark.parametrize("mode, message", FLOODS, ids=["bad-json", "missing-keys", "string-args", "positional"])
def test_parse_error_floods_are_clipped_and_count_a_few_errors(service, mode, message):
    with EnvClient(service.url, retries=0, timeout_s=60) as client:
        instance_id = client.create(TASK, "validate", {"tool_prompt_mode": mode})["instance_id"]
        reply = client.step(instance_id, message)
        content = reply["message"]["content"]
        total = sum(len(m["content"].encode()) for m in [reply["message"], *reply["extra_messages"]])
        assert total <= LIMITS.max_reply_bytes, total
        assert re.search(r"and \d+ more errors in this message", content), content[-300:]
        assert len(content) < 200 * (LIMITS.max_errors_per_message + 2)  # a few errors, not thousands
        assert reply["info"]["num_parse_errors"] > 1000  # the count is still reported in full
        client.release(instance_id)


def test_error_bodies_that_quote_the_request_are_clipped(service):
    """Ours: the HTTP error path. A megabyte-long unknown config key, bad value or reward key came back whole in the
    error's detail (1,000,238 bytes); the detail is cut, and still names the problem."""
    big = "k" * 1_000_000
    bodies = [
        ("/create", {"task_id": TASK, "mode": "validate", "params": {big: 1}}),
        ("/create", {"task_id": TASK, "mode": "validate", "params": {"tool_prompt_mode": big}}),
        ("/evaluate", {"instance_id": "ep_0", "reward": {big: 1}}),
    ]
    for path, body in bodies:
        response = requests.post(service.url + path, json=body, timeout=60)
        assert response.status_code == 422, response.text[:300]
        assert len(response.content) < 4096, len(response.content)
        assert response.json()["error"] == "invalid_config" and "config key" in response.json()["detail"]


# -- class 5: ids minted by the service; episodes answer only their owner --------------------------------


def test_ids_are_minted_and_a_kept_verdict_never_answers_for_another_episode(service, client):
    refused = requests.post(
        service.url + "/create", json={"task_id": TASK, "mode": "validate", "instance_id": "mine"}, timeout=30
    )
    assert refused.status_code == 422 and "instance_id" in refused.json()["detail"]  # no client-chosen ids
    first = client.create(TASK, "validate", request_id="same-key")["instance_id"]
    assert _passes(client, first)["valid"] is True
    assert client.evaluate(first, release=True)["valid"] is True
    second = client.create(TASK, "validate", request_id="same-key")["instance_id"]  # the key again
    assert second != first and re.fullmatch(r"ep_[0-9a-f]{32}", second)
    client.step(second, tool_call("rm", {"file_name": "nope"}))
    assert client.release(second)
    with pytest.raises(EnvServiceError) as gone:
        client.evaluate(second)  # before: the first episode's kept valid: true
    assert gone.value.status == 404
    assert client.evaluate(first)["valid"] is True  # its own kept verdict still answers its own retry


def test_another_run_cannot_touch_an_episode(service, client):
    instance_id = client.create(TASK, "validate")["instance_id"]
    for intruder in ({RUN_ID_HEADER: "other-run"}, {RUN_ID_HEADER: "addr:loopback"}):  # ours: the owner spelled
        for path, body in (
            ("/step", {"instance_id": instance_id, "content": "hi"}),
            ("/evaluate", {"instance_id": instance_id, "release": True}),
            ("/touch", {"instance_id": instance_id}),
        ):
            response = requests.post(service.url + path, json=body, headers=intruder, timeout=30)
            assert response.status_code == 404, (intruder, path, response.text)  # as if it did not exist
        response = requests.post(service.url + "/release", json={"instance_id": instance_id}, headers=intruder)
        assert response.json() == {"released": False}
    assert client.step(instance_id, "hi")["info"]["num_steps"] == 1  # untouched by the intruders
    assert client.release(instance_id)


# -- class 1: what an episode keeps has a budget ------------------------------------------------------


def _worker_rss_mib(service, instance_id: str) -> float:
    pid = worker_of(service, instance_id).process.pid
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_refused_call_floods_keep_nothing_and_big_kept_arguments_end_the_episode(service, client):
    many_small = {"path": [[] for _ in range(30_000)]}  # 120 KB of JSON, ~4 MB of Python objects
    flooder = client.create(TASK, "validate")["instance_id"]
    before = _worker_rss_mib(service, flooder)
    for _ in range(12):  # rejected: the tool is not available; its arguments were kept before
        reply = client.step(flooder, tool_call("no_such_tool", many_small) * 2)
        assert reply["info"]["error_type"] == "unavailable_tool"
    grown = _worker_rss_mib(service, flooder) - before
    started = time.monotonic()
    client.evaluate(flooder, release=True)
    assert time.monotonic() - started < LIMITS.evaluate_budget_s
    assert grown < 25, f"the worker grew by {grown:.0f} MiB for refused calls"

    keeper = client.create(TASK, "validate", LENIENT)["instance_id"]
    innocent = client.create(TASK, "validate")["instance_id"]
    ended = None
    for step in range(10):  # accepted calls keep their arguments (the verifier replays them): budgeted
        reply = client.step(keeper, tool_call("ls", many_small))
        if reply["terminated"]:
            ended = step
            break
    assert ended is not None and "memory limit" in reply["message"]["content"]
    assert client.evaluate(keeper, release=True)["valid"] is False
    assert _passes(client, innocent)["valid"] is True  # the neighbour is untouched
    client.release(innocent)


# -- class 7: a busy episode is refused at once; one owner cannot hold the shared threads ----------------


def test_a_queue_on_one_episode_is_refused_at_once_and_spares_the_others(service, client, other_client_address):
    hostile, innocent = episodes_on_two_workers(client, service, FS_TASK, TASK)
    for message in aliasing_messages():  # after these, each find runs to its budget
        client.step(hostile, message)
    slow = {"instance_id": hostile, "content": _call("find", path=".")}

    def hostile_step(k: int) -> tuple[int, str, float]:
        started = time.monotonic()
        body = {"instance_id": hostile if k < 130 else spares[k - 130], "content": slow["content"]}
        response = requests.post(service.url + "/step", json=body, timeout=120)
        return response.status_code, response.json().get("error", ""), time.monotonic() - started

    spares = [client.create(FS_TASK, "validate")["instance_id"] for _ in range(20)]  # ours: other episodes too
    with EnvClient(  # another client: all of loopback is the hostile one
        service.url, retries=0, timeout_s=10, run_id="innocent", source_address=other_client_address
    ) as neighbour:
        innocent_mine = neighbour.create(TASK, "validate")["instance_id"]
        with ThreadPoolExecutor(150) as pool:
            answers = pool.map(hostile_step, range(150))
            time.sleep(1.0)  # the queue is there now
            started = time.monotonic()
            neighbour.step(innocent_mine, "hi")  # another owner's episode: not behind the queue
            innocent_s = time.monotonic() - started
            answers = list(answers)
        assert neighbour.release(innocent_mine)  # only its owner can: a later test must find no episode left over
    assert innocent_s < 2.0, innocent_s
    refused = [a for a in answers if a[0] in (409, 429)]
    assert {a[1] for a in refused} <= {"episode_busy", "too_many_requests"}
    assert sum(a[0] == 200 for a in answers[:130]) <= 2  # one episode runs one step at a time: the rest refused
    assert max(a[2] for a in refused) < 2.0  # refused at once, not after a wait
    client.step(innocent, "hi")
    for instance_id in (hostile, innocent, *spares):
        assert client.release(instance_id)


def test_a_clients_many_budget_busting_episodes_delay_another_clients_steps_by_one_message_at_most():
    """Ours: the queue spread over many episodes of one client. Each of its 8 episodes keeps a message in flight
    that runs to the budget, all on the one worker that the innocent episode shares; the innocent's create and
    steps go ahead of them (its owner used the worker least), waiting only for the message that is running."""
    budget = LIMITS.message_budget_s
    with ServerThread(EpisodeManager(workers=1, limits=LIMITS)) as server:
        with EnvClient(server.url, retries=0, timeout_s=120, run_id="hostile") as attacker:
            hostile = [attacker.create(FS_TASK, "validate")["instance_id"] for _ in range(8)]
            for instance_id in hostile:
                for message in aliasing_messages():  # after these, each find runs to its budget
                    attacker.step(instance_id, message)
            stop = threading.Event()

            def keep_busy(instance_id: str) -> None:
                while not stop.is_set():
                    attacker.step(instance_id, _call("find", path="."))

            with ThreadPoolExecutor(len(hostile)) as pool:
                futures = [pool.submit(keep_busy, instance_id) for instance_id in hostile]
                time.sleep(2 * budget)  # every hostile episode has a message queued or running
                waits = []
                with EnvClient(server.url, retries=0, timeout_s=120, run_id="innocent") as innocent:
                    started = time.monotonic()
                    instance_id = innocent.create(TASK, "validate")["instance_id"]
                    waits.append(time.monotonic() - started)
                    for message in replay.ground_truth_messages(tasks.load_task(TASK)):
                        started = time.monotonic()
                        innocent.step(instance_id, message)
                        waits.append(time.monotonic() - started)
                    verdict = innocent.evaluate(instance_id, release=True)
                stop.set()
                for future in futures:
                    future.result()
    assert verdict["valid"] is True
    # before: each step waited behind most of the 8 queued messages (~8 budgets)
    assert max(waits) < 2 * budget, waits


# -- class 6: owners and their profiles ---------------------------------------------------------------


def test_minting_run_ids_neither_evicts_a_live_runs_profile_nor_dodges_the_limits():
    manager = EpisodeManager()
    cues, params = (
        {"tags": {"missing_tool_call": {"count": 40, "reward_mean": 0.1}}},
        {"capability_cues": {"enable": True}},
    )
    manager.set_profile(cues, run_id="victim")
    live = manager.create(TASK, "train", params, owner="run:victim", run_id="victim")
    for i in range(2 * MAX_RUN_PROFILES):  # the 64 pushes, and more
        manager.set_profile({"tags": {}}, run_id=f"minted-{i}")
    assert manager.get_profile("victim")["profile"] == cues  # evicted before: its train episodes lost their cues
    again = manager.create(TASK, "train", params, owner="run:victim", run_id="victim")
    assert again["info"]["capability_cues"] is True
    for episode in (live, again):
        manager.release(episode["instance_id"])

    limits = HttpLimits(max_run_ids_per_peer=3)
    with ServerThread(EpisodeManager(limits=LIMITS), limits=limits) as server:
        statuses = []
        for i in range(6):  # ours: minting run ids over HTTP from one address
            response = requests.post(
                server.url + "/profile", json={"profile": {}}, headers={RUN_ID_HEADER: f"mint-{i}"}, timeout=30
            )
            statuses.append((response.status_code, response.json().get("error")))
        assert statuses[:3] == [(200, None)] * 3
        assert statuses[3:] == [(429, "too_many_run_ids")] * 3
        reused = requests.post(server.url + "/profile", json={"profile": {}}, headers={RUN_ID_HEADER: "mint-0"})
        assert reused.status_code == 200  # a run id in use still works


# -- class 10: scratch folders never outlive their service; a stopped worker shows in /health --------------

OOD_TASK = "memory_kv_prereq_32-notetaker-0"


def _scratch_folders(root: str) -> list[str]:
    return [os.path.join(d, f) for d in os.listdir(root) for f in os.listdir(os.path.join(root, d))]


def test_a_stopped_worker_shows_in_health_and_no_scratch_folder_outlives_its_worker(service, client):
    pool = service.manager._pool
    stale = tempfile.mkdtemp(prefix=f"seal-env-{2**22 + 12345}-")  # ours: a root left by a killed service
    victim, survivor = episodes_on_two_workers(client, service, OOD_TASK, TASK)
    (folder,) = _scratch_folders(pool.scratch)  # the OOD episode's folder, inside this service's root
    worker = worker_of(service, victim)
    os.kill(worker.process.pid, signal.SIGSTOP)  # idle: no request to it is overdue, only the heartbeat says so
    started = time.monotonic()
    while requests.get(service.url + "/health", timeout=10).status_code == 200:
        assert time.monotonic() - started < HEARTBEAT_TIMEOUT_S + 3, "a stopped worker still reads as ok"
        time.sleep(0.1)
    os.kill(worker.process.pid, signal.SIGKILL)
    assert client.step(victim, "hi")["info"]["num_steps"] == 1  # rebuilt on the replacement, in a folder of its own
    assert folder not in _scratch_folders(pool.scratch)  # the killed worker's folders went with it
    assert len(_scratch_folders(pool.scratch)) == 1
    assert client.step(survivor, "hi")["info"]["num_steps"] == 1
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)  # the replacement's own heartbeat is what keeps it ok now
    assert requests.get(service.url + "/health", timeout=10).status_code == 200
    with ServerThread(EpisodeManager(workers=1, limits=LIMITS)) as other:
        root = other.manager._pool.scratch
        assert not os.path.exists(stale)  # swept when the next service started
        with EnvClient(other.url, retries=0, timeout_s=60) as c:
            c.create(OOD_TASK, "validate")
        assert len(_scratch_folders(root)) == 1
    assert not os.path.exists(root)  # removed when the service stopped, its episode still live


# -- class 8: connection hoarding, slow senders, and per-address limits dodged by source address -----------------


def _kept_alive(url_port: int, source: str = "127.0.0.1") -> socket.socket | None:
    """A connection from ``source`` that served one request and stays open (idle, kept alive); None if refused."""
    sock = socket.create_connection(("127.0.0.1", url_port), timeout=5, source_address=(source, 0))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: hog\r\n\r\n")
    answer = sock.recv(65536)
    if not answer.startswith(b"HTTP/1.1 200"):
        sock.close()
        return None
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.02)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_hoarded_idle_connections_are_shed_before_anyone_is_refused():
    limits = HttpLimits(max_connections=120, max_connections_per_peer=50)
    with ServerThread(EpisodeManager(limits=LIMITS), limits=limits) as server:
        hoard = [s for s in (_kept_alive(server.port) for _ in range(200)) if s is not None]  # ours: 200 > both caps
        assert len(hoard) == 200  # each new one was let in by shedding an idle one
        with EnvClient(server.url, retries=0, timeout_s=30) as innocent:  # before: 503 for everyone else
            instance_id = innocent.create(TASK, "validate")["instance_id"]
            assert innocent.step(instance_id, "hi")["info"]["num_steps"] == 1
        time.sleep(0.2)  # closes reach the sockets
        still_open = sum(not _closed_by_server(s) for s in hoard)
        assert still_open <= limits.max_connections_per_peer  # the oldest idle ones were shed
        for sock in hoard:
            sock.close()


#: How a slow sender starts its request, and then sends nothing more (the read timeout, 30 s, is far away).
SLOW_STARTS = {
    "body": b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{",
    "headers": b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Ty",
    "nothing": b"",
}
HOLD = "hold this step until the test lets it go"


class HoldingManager(EpisodeManager):
    """Steps whose content is ``HOLD`` wait, in processing, until the test sets ``release``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.holding, self.release = threading.Event(), threading.Event()

    def step(self, instance_id, content, seq=None, owner=None) -> dict:
        if content == HOLD:
            self.holding.set()
            self.release.wait(60)
        return super().step(instance_id, content, seq=seq, owner=owner)


def _slow_sender(port: int, start: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(start)
    return sock


@pytest.mark.parametrize("start", SLOW_STARTS.values(), ids=SLOW_STARTS)
def test_slow_senders_are_shed_for_an_innocent_and_a_request_in_processing_never_is(start):
    limits = HttpLimits(max_connections=120, max_connections_per_peer=20)
    manager = HoldingManager(limits=LIMITS)
    with ServerThread(manager, limits=limits) as server, EnvClient(server.url, retries=0, timeout_s=60) as busy:
        held = busy.create(TASK, "validate")["instance_id"]
        with ThreadPoolExecutor(1) as pool:
            in_processing = pool.submit(busy.step, held, HOLD)
            assert manager.holding.wait(30)
            slow = [_slow_sender(server.port, start) for _ in range(30)]  # ours: 30 > the cap, all from loopback
            with EnvClient(server.url, retries=0, timeout_s=30) as innocent:  # before, slow bodies: 503 for it
                instance_id = innocent.create(TASK, "validate")["instance_id"]
                assert innocent.step(instance_id, "hi")["info"]["num_steps"] == 1
            time.sleep(0.2)  # closes reach the sockets
            still_open = sum(not _closed_by_server(s) for s in slow)
            manager.release.set()
            assert in_processing.result(timeout=30)["info"]["num_steps"] == 1  # its connection was never cut
    # The cap less the held step's connection and the innocent's: the oldest slow ones were shed.
    assert still_open <= limits.max_connections_per_peer - 2
    for sock in slow:
        sock.close()


def test_a_client_between_requests_keeps_its_connection_while_slow_senders_are_shed():
    limits = HttpLimits(max_connections=120, max_connections_per_peer=10)
    with ServerThread(EpisodeManager(limits=LIMITS), limits=limits) as server:
        slow = [_slow_sender(server.port, SLOW_STARTS["body"]) for _ in range(9)]
        kept = _kept_alive(server.port)  # answered just now: the connection that has waited least
        newcomers = [_slow_sender(server.port, SLOW_STARTS["body"]) for _ in range(5)]  # ours: over the cap
        time.sleep(0.2)  # closes reach the sockets
        assert not _closed_by_server(kept)  # before: shed for the first newcomer, the only idle connection
        assert [_closed_by_server(s) for s in slow] == [True] * 5 + [False] * 4  # the longest waiting went
        kept.settimeout(5)
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        for sock in [*slow, kept, *newcomers]:
            sock.close()


LOOPBACK_SOURCES = [f"127.0.0.{k}" for k in range(1, 21)]  # every one is this machine: bindable by any client


@pytest.fixture(scope="module")
def small_caps_service():
    limits = HttpLimits(max_connections=120, max_connections_per_peer=10, max_run_ids_per_peer=2)
    with ServerThread(EpisodeManager(limits=LIMITS), limits=limits) as server:
        yield server


def _post_from(source: str, port: int, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    """POST ``body`` as JSON on a connection of its own from the loopback address ``source``: (status, JSON)."""
    payload = json.dumps(body).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"Connection: close\r\n{head}\r\n"
    ).encode() + payload
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
        sock.sendall(request)
        response = b"".join(iter(lambda: sock.recv(65536), b""))
    status_line, _, answer = response.partition(b"\r\n\r\n")
    return int(status_line.split(b" ", 2)[1]), json.loads(answer)


def test_loopback_source_addresses_share_one_connection_cap(small_caps_service):
    cap = small_caps_service.app.state.http_limits.max_connections_per_peer
    hoard = [_kept_alive(small_caps_service.port, source) for source in LOOPBACK_SOURCES]  # ours: 2x the cap
    time.sleep(0.2)  # closes reach the sockets
    still_open = sum(s is not None and not _closed_by_server(s) for s in hoard)
    assert still_open <= cap  # before: 20, one cap per address
    for sock in hoard:
        if sock is not None:
            sock.close()


def test_loopback_source_addresses_share_one_run_id_quota(small_caps_service):
    answers = [
        _post_from(source, small_caps_service.port, "/profile", {"profile": {}}, {RUN_ID_HEADER: f"minted-{k}"})
        for k, source in enumerate(LOOPBACK_SOURCES[1:4])
    ]
    assert [status for status, _ in answers] == [200, 200, 429]  # before: 200 from every new address
    assert answers[2][1]["error"] == "too_many_run_ids"


def test_loopback_source_addresses_are_one_owner_for_header_less_requests(small_caps_service):
    with EnvClient(small_caps_service.url, retries=0, timeout_s=30) as client:  # from 127.0.0.1, no run id
        instance_id = client.create(TASK, "validate")["instance_id"]
    status, reply = _post_from(
        "127.0.0.2", small_caps_service.port, "/step", {"instance_id": instance_id, "content": "hi"}
    )
    assert status == 200 and reply["info"]["num_steps"] == 1  # before: 404, another owner
    assert _post_from("127.0.0.3", small_caps_service.port, "/release", {"instance_id": instance_id}) == (
        200,
        {"released": True},
    )


# -- class 2: a worker's death costs only the episode it died on (none, when it died between requests) -------------


def test_a_killed_workers_innocent_episodes_are_rebuilt_on_its_replacement(service, client):
    offender = client.create(TASK, "validate")["instance_id"]
    worker = worker_of(service, offender)
    innocents, elsewhere = [], []
    while len(innocents) < 2 and len(elsewhere) < 20:  # two more beside it (placement spreads them over workers)
        instance_id = client.create(TASK, "validate")["instance_id"]
        (innocents if worker_of(service, instance_id) is worker else elsewhere).append(instance_id)
    for instance_id in elsewhere:
        client.release(instance_id)
    assert len(innocents) == 2
    messages = replay.ground_truth_messages(tasks.load_task(TASK))
    half = len(messages) // 2
    for message in messages[:half]:
        client.step(innocents[0], message)
    client.step(innocents[1], "<tool_call>{bad}</tool_call>" * 50)  # ours: one that made mistakes replays them too
    for message in messages[:half]:
        client.step(innocents[1], message)
    os.kill(worker.process.pid, signal.SIGKILL)  # between requests: no episode's doing (round 3: no one is blamed)
    assert client.step(offender, "hi")["info"]["num_steps"] == 1
    for instance_id in innocents:  # before: episode_lost for both
        for message in messages[half:]:
            client.step(instance_id, message)
        assert client.evaluate(instance_id, release=True)["valid"] is True
