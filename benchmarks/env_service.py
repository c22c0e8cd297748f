"""Environment-service throughput and memory, in one run.

    python benchmarks/env_service.py            # full: 400 held-out tasks, 5,000-episode memory run
    python benchmarks/env_service.py --quick    # smoke version (a test runs it so the script cannot rot)
    python benchmarks/env_service.py --only "slow bodies from loopback addresses"   # one attack class of 5. alone
    python benchmarks/env_service.py --side-by-side /tmp/base   # HTTP@32 against another checkout, alternating

Measures, on the ground-truth replay of the held-out split (every episode: create, one message per GT
turn with the calls plus one plain-text message per turn, evaluate, release):

1. episodes/s in-process (``InProcessEnvClient``, one thread: the GIL makes more threads pointless);
2. episodes/s over HTTP against a service subprocess (default workers: one per usable CPU), at concurrency 1
   and 32;
3. episodes/s over HTTP at concurrency 32 with ``--workers 1`` and ``--workers 2``: the multi-core gain;
4. episodes/s of bare bfcl-eval: ``multi_turn_checker`` on the same GT (one step per turn, fresh model
   name per entry, registry cleanup) — the verifier alone, without parsing, turns or our isolation;
5. an innocent client's step latency (p50/p99, GT replays one step at a time) while another client keeps
   sending messages that each exhaust the message budget (``find`` over a file system whose directories
   alias each other, 2**40 entries), on a service with a 1 s message budget and 2 workers; then the same
   innocent client (4 episodes live at a time, so some share the attacker's worker) while each attack class of
   :data:`ATTACKS` and :data:`WORKER_ATTACKS` runs (step p99, episodes lost, RSS growth, the attack's own figures:
   ids answered that were not the attacker's, wrong verdicts, connections to refused fetch targets, worker kills
   by an episode's message or from outside, slow-body connections the service closed);
   and a stopped (SIGSTOP) worker: seconds until /health says 503, the other worker's innocent episode meanwhile,
   and the scratch folders left after repeated worker kills;
6. the service's RSS (main process + workers) after 500 and after 5,000 episodes (fresh service; psutil).

Targets: HTTP@32 within 3x of in-process (slowdown = in-process eps / HTTP@32 eps <= 3); 2 workers >= 1.6x
1 worker (needs 2 idle cores); innocent p99 <= 2x the message budget; memory flat (RSS after 5,000 / after
500 close to 1). Exit code 1 when a replay has errors or unexpected failures (with ``--only``: when an innocent
episode was lost).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from env_service import replay  # noqa: E402
from env_service.bfcl import tasks, upstream  # noqa: E402  (upstream sets BFCL_PROJECT_ROOT before any bfcl import)
from env_service.client import EnvClient, InProcessEnvClient  # noqa: E402
from env_service.http.auth import RUN_ID_HEADER  # noqa: E402

SLOWDOWN_TARGET = 3.0
MEMORY_TARGET = 1.25
WORKER_SCALING_TARGET = 1.6
HOSTILE_BUDGET_S = 1.0  # message budget of the service in the hostile-neighbour measurement
LATENCY_TARGET = 2.0  # innocent p99 / message budget


# ---------------------------------------------------------------------------------------------
# Service subprocess
# ---------------------------------------------------------------------------------------------


class ServiceProcess:
    """``python -m env_service serve`` on a free port; stopped on exit."""

    def __init__(self, *flags: str, env: dict | None = None):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        # A file, not a pipe nobody reads: a service that logs a warning per refused request would block once
        # 64 KiB of them filled the pipe.
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "env_service", "serve", "--port", str(self.port), "--log-level", "warning", *flags],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

    def __enter__(self) -> ServiceProcess:
        client = EnvClient(self.url, retries=0, timeout_s=5)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"service exited: {self.log.read().decode()[-2000:]}")
            try:
                client.health()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise RuntimeError("service did not start within 120 s") from None
                time.sleep(0.2)

    def rss_mib(self, workers: bool = True) -> float:
        """RSS of the service and (``workers``) its worker processes."""
        import psutil

        main = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [main, *(main.children(recursive=True) if workers else [])]) / 2**20

    def workers(self) -> list[dict]:
        """/health's row per worker process (pid, episodes, restarts), answered 200 or 503."""
        import requests

        return requests.get(self.url + "/health", timeout=30).json()["workers"]["per_worker"]

    def __exit__(self, *exc_info) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def timed_replay(client, task_ids: list[str], concurrency: int) -> dict:
    started = time.perf_counter()
    results = replay.replay_split(client, task_ids, concurrency=concurrency)
    seconds = time.perf_counter() - started
    summary = replay.summarize(results)
    return {
        "episodes": len(results),
        "seconds": seconds,
        "eps": len(results) / seconds,
        "passed": summary["total"]["passed"],
        "ok": summary["ok"],
    }


def bare_checker(task_ids: list[str]) -> dict:
    """bfcl-eval alone: multi_turn_checker on the GT, fresh model name per entry, then cleanup."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    entries, answers = {}, {}
    for category in tasks.CATEGORIES:
        bfcl_category = f"multi_turn_{category}"
        for entry in upstream.load_dataset_entry(
            bfcl_category, include_prereq=False, include_language_specific_hint=False
        ):
            entries[entry["id"]] = entry
        for answer in upstream.load_ground_truth_entry(bfcl_category):
            answers[answer["id"]] = answer["ground_truth"]
    registry = vars(multi_turn_utils)
    passed = 0
    started = time.perf_counter()
    for n, task_id in enumerate(task_ids):
        gt = answers[task_id]
        model_name = f"bench_{n}"
        result = multi_turn_checker(
            [[turn] for turn in gt], gt, entries[task_id], task_id.rsplit("_", 1)[0], model_name
        )
        passed += bool(result["valid"])
        for key in [k for k in registry if k.startswith(model_name + "_")]:
            del registry[key]
    seconds = time.perf_counter() - started
    return {"episodes": len(task_ids), "seconds": seconds, "eps": len(task_ids) / seconds, "passed": passed, "ok": True}


def workers_scaling(task_ids: list[str]) -> dict:
    """HTTP@32 throughput with one worker process and with two."""
    figures = {}
    for workers in (1, 2):
        with ServiceProcess("--workers", str(workers)) as service, EnvClient(service.url, pool_size=32) as client:
            replay.replay_split(client, task_ids[:8], concurrency=8)  # warm-up
            figures[f"workers_{workers}"] = timed_replay(client, task_ids, 32)
    return figures


def another_client_address() -> str | None:
    """A local IPv4 address beyond loopback, or None. The service counts its limits per client address and all of
    loopback is one client; a connection to 127.0.0.1 that leaves from this address is another client."""
    import ipaddress

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return address.address
    return None


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def aliasing_messages(doublings: int = 40, per_message: int = 8) -> list[str]:
    """File-system messages after which the tree under ``a`` has about 2**doublings entries (each round of
    copy and moves doubles what a traversal visits, while the stored state grows by a few objects)."""
    one = [
        _call("cp", source="a", destination="b"),
        _call("mkdir", dir_name="c"),
        _call("mv", source="a", destination="c"),
        _call("mv", source="b", destination="c"),
        _call("mv", source="c", destination="a"),
    ]
    messages = [_call("mkdir", dir_name="a")]
    for i in range(0, doublings, per_message):
        messages.append("".join(c for _ in range(min(per_message, doublings - i)) for c in one))
    return messages


def hostile_neighbour(task_ids: list[str], innocent_threads: int = 4) -> dict:
    """Innocent GT replays (``innocent_threads`` at a time) while a hostile client exhausts the budget."""
    flags = (
        "--workers",
        "2",
        "--message-budget-s",
        str(HOSTILE_BUDGET_S),
        "--call-budget-s",
        str(HOSTILE_BUDGET_S),
        "--evaluate-budget-s",
        str(2 * HOSTILE_BUDGET_S),
    )
    stop, hostile_steps, latencies, valid, failures = threading.Event(), [], [], [], []

    def hostile(url: str) -> None:
        try:
            hostile_episodes(url)
        except Exception as error:  # noqa: BLE001 - reported by the main thread, which would wait for it forever
            failures.append(error)

    def hostile_episodes(url: str) -> None:
        with EnvClient(url, retries=0, timeout_s=120, run_id="hostile") as client:
            while not stop.is_set():
                iid = client.create("multi_turn_base_0", "validate")["instance_id"]
                for message in aliasing_messages():
                    client.step(iid, message)
                for _ in range(50):  # within max_steps
                    if stop.is_set():
                        break
                    started = time.perf_counter()
                    client.step(iid, _call("find", path="."))
                    hostile_steps.append(time.perf_counter() - started)
                client.release(iid)

    def innocent(url: str, ids: list[str]) -> None:
        with EnvClient(url, retries=0, timeout_s=120, run_id="innocent") as client:
            for task_id in ids:
                iid = client.create(task_id, "validate")["instance_id"]
                for message in replay.ground_truth_messages(tasks.load_task(task_id)):
                    started = time.perf_counter()
                    client.step(iid, message)
                    latencies.append(time.perf_counter() - started)
                valid.append(client.evaluate(iid, release=True)["valid"])

    ids = [t for t in task_ids if t not in replay.EXPECTED_FAILURES]
    with ServiceProcess(*flags) as service:
        attacker = threading.Thread(target=hostile, args=(service.url,))
        attacker.start()
        while not hostile_steps and attacker.is_alive():  # its first budget-busting message is answered
            time.sleep(0.05)
        if failures:
            raise RuntimeError("the hostile client failed before its first message") from failures[0]
        with ThreadPoolExecutor(innocent_threads) as pool:
            list(pool.map(lambda k: innocent(service.url, ids[k::innocent_threads]), range(innocent_threads)))
        stop.set()
        attacker.join()
        health = EnvClient(service.url, retries=0).health()
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {
        "innocent_steps": len(latencies),
        "p50_s": statistics.median(latencies),
        "p99_s": p99,
        "max_s": latencies[-1],
        "budget_s": HOSTILE_BUDGET_S,
        "p99_over_budget": p99 / HOSTILE_BUDGET_S,
        "hostile_messages": len(hostile_steps),
        "hostile_mean_s": statistics.mean(hostile_steps),
        "innocent_valid": sum(valid),
        "innocent_episodes": len(valid),
        "worker_restarts": health["workers"]["worker_restarts"],
        "ok": sum(valid) == len(valid),
    }


def _deep_names(client, stop) -> None:
    names = ["a." * 5000 + "a", "a" + "()" * 5000, "-" * 20000 + "a", "lambda: " * 3000 + "a"]
    while not stop.is_set():
        iid = client.create("multi_turn_base_0", "validate", {"enforce_available_tools": False})["instance_id"]
        for name in names * 20:
            if stop.is_set():
                break
            client.step(iid, _call(name))
        client.release(iid)


def _parse_floods(client, stop) -> None:
    while not stop.is_set():
        iid = client.create("multi_turn_base_0", "validate")["instance_id"]
        for _ in range(20):
            if stop.is_set():
                break
            client.step(iid, "<tool_call>{bad}</tool_call>" * 9000)
        client.release(iid)


def _refused_call_floods(client, stop) -> None:
    many_small = {"path": [[] for _ in range(30_000)]}
    while not stop.is_set():
        iid = client.create("multi_turn_base_0", "validate")["instance_id"]
        for _ in range(40):
            if stop.is_set():
                break
            client.step(iid, _call("no_such_tool", **many_small) * 2)
        client.release(iid)


def _busy_queue(client, stop) -> None:
    import requests

    iid = client.create("multi_turn_base_0", "validate")["instance_id"]
    for message in aliasing_messages():
        client.step(iid, message)
    body = {"instance_id": iid, "content": _call("find", path=".")}
    with ThreadPoolExecutor(80) as pool:
        while not stop.is_set():
            list(pool.map(lambda _: requests.post(client.url + "/step", json=body, timeout=60), range(80)))


def _busy_episodes(client, stop) -> dict:
    """Budget-busting ``find``s on 16 episodes at once, each with a message always queued or running: the innocent's
    requests go first on the workers (its owner used them least), so it waits for the running message only."""
    import requests

    def prepared() -> str:
        iid = client.create("multi_turn_base_0", "validate")["instance_id"]
        for message in aliasing_messages():
            client.step(iid, message)
        return iid

    episodes = [prepared() for _ in range(16)]
    steps = []

    def keep_busy(iid: str) -> None:
        body = {"instance_id": iid, "content": _call("find", path=".")}
        while not stop.is_set():
            response = requests.post(client.url + "/step", json=body, headers={RUN_ID_HEADER: "attacker"}, timeout=600)
            steps.append(response.status_code)

    with ThreadPoolExecutor(len(episodes)) as pool:
        list(pool.map(keep_busy, episodes))
    for iid in episodes:
        client.release(iid)
    return {"attacker messages answered": f"{steps.count(200)}/{len(steps)}"}


def _long_messages_in_bursts(client, stop) -> dict:
    """One episode's messages that each run until a budget stops them (up to the 1-s message budget), in bursts: while its worker is calm between bursts it
    is given innocent episodes, which the next burst finds there (the red team's case: 4-s messages, each under the
    budget, took another client's step p99 from 9 ms to 3.4 s). Such an episode is moved to the calm worker after
    ``--move-after-s`` behind a long message, instead of waiting it out."""
    from env_service.workers.pool import BUSY_WINDOW_S

    iid = client.create("multi_turn_base_0", "validate")["instance_id"]
    for message in aliasing_messages():
        client.step(iid, message)
    moved_before, messages = client.health()["workers"]["episodes_moved"], 0
    while not stop.wait(BUSY_WINDOW_S * 0.6):  # its worker calms down: new episodes land there again
        for _ in range(3):
            client.step(iid, _call("find", path="."))
            messages += 1
    client.release(iid)
    return {"long messages": messages, "episodes moved": client.health()["workers"]["episodes_moved"] - moved_before}


def _minted_run_ids(client, stop) -> None:
    import requests

    for k in itertools.count():
        if stop.is_set():
            break
        requests.post(client.url + "/profile", json={"profile": {}}, headers={RUN_ID_HEADER: f"mint-{k}"}, timeout=30)


def _connection_hoard(client, stop) -> None:
    hoard = []
    host, port = client.url.rsplit("/", 1)[-1].split(":")
    while not stop.is_set() and len(hoard) < 3000:
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: hog\r\n\r\n")
        sock.recv(65536)
        hoard.append(sock)
    stop.wait()
    for sock in hoard:
        sock.close()


#: Where each slow-body connection comes from: more than the service's 1,024 per address from 127.0.0.1 alone, and
#: more from other loopback addresses (any process here may bind them; the service counts all of loopback as one).
SLOW_BODY_SOURCES = ["127.0.0.1"] * 1100 + [f"127.0.0.{2 + k % 10}" for k in range(100)]
SLOW_BODY_START = (
    b"POST /step HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
)


def _slow_bodies(client, stop) -> dict:
    """A request body trickled a byte a second on each of ``SLOW_BODY_SOURCES``' connections, each reopened when the
    service closes it. Unless shed, such a connection is held for the read timeout (30 s): before the service shed
    them, 1,024 from 127.0.0.1 locked every other loopback client out (503)."""
    host, port = client.url.rsplit("/", 1)[-1].split(":")
    held: list[socket.socket | None] = [None] * len(SLOW_BODY_SOURCES)
    opened = closed = 0
    while not stop.is_set():
        for slot, source in enumerate(SLOW_BODY_SOURCES):
            if held[slot] is not None and not _trickled(held[slot]):
                held[slot].close()
                held[slot], closed = None, closed + 1
            if held[slot] is None and not stop.is_set():
                held[slot] = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
                held[slot].sendall(SLOW_BODY_START)
                held[slot].setblocking(False)
                opened += 1
        stop.wait(1.0)
    for sock in held:
        if sock is not None:
            sock.close()
    return {"slow-body connections opened": opened, "closed by the service": closed}


def _trickled(sock: socket.socket) -> bool:
    """One more byte of the body (JSON whitespace) on ``sock``; False when the service has closed it."""
    try:
        sock.recv(1)
        return False  # the service closed it, or answered it (a refusal): done
    except BlockingIOError:
        pass  # nothing to read: still open
    except OSError:
        return False
    try:
        sock.send(b" ")
    except BlockingIOError:
        pass  # the service is not reading it yet: this byte waits
    except OSError:
        return False
    return True


def _guessed_ids(client, stop) -> dict:
    """Ids that are not the attacker's to use: random ``ep_`` ids, released ones, its own live episode asked for
    under another run id, and a reused ``request_id`` whose first episode passed (its verdict must not answer)."""
    import uuid

    answered = wrong_verdicts = 0
    messages = replay.ground_truth_messages(tasks.load_task(PASSING_TASK))
    with EnvClient(client.url, retries=0, timeout_s=60, run_id="attacker-2") as other_run:
        while not stop.is_set():
            first = client.create(PASSING_TASK, "validate", request_id="reused")["instance_id"]
            for message in messages:
                client.step(first, message)
            client.evaluate(first, release=True)
            second = client.create(PASSING_TASK, "validate", request_id="reused")["instance_id"]
            client.step(second, _call("rm", file_name="nope"))
            client.release(second)
            live = client.create(PASSING_TASK, "validate")["instance_id"]
            guesses = [(client, f"ep_{uuid.uuid4().hex}"), (client, second), (other_run, live)]
            for asker, iid in guesses:
                verdict = _answers(lambda asker=asker, iid=iid: asker.evaluate(iid))
                answered += verdict is not None
                wrong_verdicts += verdict is not None and verdict["valid"]  # the issue's: the first one's verdict
            # A released episode's own kept verdict answers its retry (evaluate), but nothing else does.
            for asker, iid in [*guesses, (client, first)]:
                answered += _answers(lambda asker=asker, iid=iid: asker.step(iid, "hi")) is not None
                answered += bool(_answers(lambda asker=asker, iid=iid: asker.release(iid)))
            client.release(live)
    return {"requests answered on ids not the attacker's": answered, "wrong verdicts": wrong_verdicts}


def _answers(request):
    """The answer to ``request``, or None when the service refuses it (404: no such episode for this client)."""
    from env_service.client import EnvServiceError

    try:
        return request()
    except EnvServiceError as error:
        if error.status != 404:
            raise
        return None


def _forged_fetches(client, stop) -> dict:
    """``fetch_url_content`` (web-search backend, fake search key) aimed at this machine under many spellings of
    loopback, and at the service itself; a loopback listener counts the connections that got through. Only
    127.0.0.0/8 is ever named, so nothing leaves the machine even if the guard failed."""
    listener = socket.create_server(("127.0.0.1", 0))
    port, accepted = listener.getsockname()[1], []
    listener.settimeout(0.2)

    def count_accepts() -> None:
        while not stop.is_set():
            try:
                listener.accept()[0].close()
                accepted.append(1)
            except TimeoutError:
                continue

    counter = threading.Thread(target=count_accepts)
    counter.start()
    hosts = [
        "127.0.0.1",
        "localhost",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
    ]
    urls = [f"http://{host}:{port}/" for host in hosts] + [
        client.url + "/health",
        f"http://127.0.0.1:{port}@127.0.0.2/",
    ]
    fetches = refused = 0
    try:
        while not stop.is_set():
            iid = client.create(WEB_TASK, "validate")["instance_id"]
            for url in urls:
                if stop.is_set():
                    break
                content = client.step(iid, _call("fetch_url_content", url=url))["message"]["content"]
                fetches += 1
                refused += "not a public address" in content or "only http and https" in content
            client.release(iid)
    finally:
        counter.join()
        listener.close()
    return {"fetches refused": f"{refused}/{fetches}", "connections to refused targets": len(accepted)}


def _kills_its_worker(client, stop) -> dict:
    """Budget-busting ``find``s on a service with no worker grace: the worker misses its deadline and is killed."""
    killed = 0
    while not stop.is_set():
        killed += _killed_by_its_message(client)
    return {"attacker episodes lost with their worker": killed}


# ---- Round 3, pipelining and bodies in flight (issue 24 items 1, 2) ----------------------------------------------

PIPELINED_CONNECTIONS = 64
PIPELINED = b"GET /health HTTP/1.1\r\nHost: pipe\r\n\r\n" * (2 * 2**20 // 34)  # ~2 MiB of requests, never read
BODY_CONNECTIONS = 256


def _keep_sending(client, stop, connections: int, data: bytes, receive_buffer: int | None = None) -> dict:
    """``data`` sent (as far as the service reads it) and never a byte read back, on each of ``connections``
    connections, each reopened when the service closes it: the service sees ``connections`` x ``data`` in flight.
    ``receive_buffer``: each connection's (small: what it does not take of its answers stays with the service)."""
    host, port = client.url.rsplit("/", 1)[-1].split(":")
    held: list[tuple[socket.socket, int] | None] = [None] * connections  # connection, bytes sent on it (-1: failed)
    opened = closed = 0
    while not stop.is_set():
        for slot in range(connections):
            if held[slot] is None:
                sock = socket.socket()
                if receive_buffer:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
                sock.settimeout(5)
                sock.connect((host, int(port)))
                sock.setblocking(False)
                held[slot], opened = (sock, 0), opened + 1
            sock, sent = held[slot]
            try:
                if sent < len(data):
                    sent += sock.send(data[sent : sent + 2**18])
            except BlockingIOError:  # the service reads no more of it for now
                pass
            except OSError:
                sent = -1
            if sent < 0 or _peer_closed(sock):
                sock.close()
                held[slot], closed = None, closed + 1
            else:
                held[slot] = (sock, sent)
        stop.wait(0.05)
    for entry in held:
        if entry is not None:
            entry[0].close()
    return {"connections opened": opened, "closed by the service": closed}


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the service closed ``sock``, without reading what it sent (answers are never read)."""
    poll = select.poll()
    poll.register(sock, select.POLLRDHUP)
    return bool(poll.poll(0))


def _pipelined_requests(client, stop) -> dict:
    """~2 MiB of pipelined ``GET /health`` on each of 64 connections whose answers are never read: before, every
    request was parsed at once (~150 MiB per connection kept by the service)."""
    return _keep_sending(client, stop, PIPELINED_CONNECTIONS, PIPELINED)


def _bodies_in_flight(client, stop) -> dict:
    """All but the last byte of a 2 MiB body on each of 256 connections: before, every one was buffered
    (512 MiB); now they share the service's budget for bodies in flight (64 MiB), the longest waiting shed."""
    body = 2 * 2**20
    start = b"POST /step HTTP/1.1\r\nHost: body\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % body
    return _keep_sending(client, stop, BODY_CONNECTIONS, start + b" " * (body - 1))


def _from_another_address(client, run_id: str, **options):
    """An EnvClient of another client than loopback (the innocent's), naming ``run_id``; None on a machine without a
    local address beyond loopback (an attack from loopback would be the innocent's own client)."""
    address = another_client_address()
    if address is None:
        return None
    return EnvClient(client.url, retries=0, timeout_s=120, run_id=run_id, source_address=address, **options)


def _run_ids_fill_the_service(client, stop) -> dict:
    """One client naming 4 run ids creates episodes until refused and holds them: before, each run id had the
    per-client cap (1,024), so 4 of them held all 4,096 episodes of the service and every other client got 503."""
    from env_service.client import EnvServiceError

    runs = [_from_another_address(client, f"filler-{k}") for k in range(4)]
    if None in runs:
        return {"skipped": "no local address beyond loopback"}
    held: list[tuple] = []

    def fill(run) -> None:
        while not stop.is_set():
            try:
                held.append((run, run.create(PASSING_TASK, "validate")["instance_id"]))
            except EnvServiceError as error:
                if error.status not in (429, 503):
                    raise
                stop.wait(0.5)  # refused: hold what it has

    with ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(fill, runs))
    for run, iid in held:
        run.release(iid)
    return {"episodes the 4 run ids held": len(held)}


#: Episodes the flooding client finishes: more than one client's kept verdicts (``evaluations_kept_per_client``), which
#: was also all clients' together before (one pool of 2,048). ``--quick`` keeps 100 verdicts a client and floods 200.
FLOOD_EPISODES = 2148
QUICK_KEPT_PER_CLIENT, QUICK_FLOOD_EPISODES = 100, 200


def _finished_episodes_flood(client, stop, episodes: int = FLOOD_EPISODES) -> dict:
    """Another client finishes ``episodes`` cheap episodes; then the verdict an innocent (loopback) client was
    given just before must still answer its retried ``evaluate(release)`` (before: 404, evicted from the one pool)."""
    flood = _from_another_address(client, "flood", pool_size=8)
    if flood is None:
        return {"skipped": "no local address beyond loopback"}
    with EnvClient(client.url, retries=0, timeout_s=120, run_id="innocent") as innocent:
        iid = innocent.create(PASSING_TASK, "validate")["instance_id"]
        verdict = innocent.evaluate(iid, release=True)

        def finish(_) -> None:
            flood.evaluate(flood.create(PASSING_TASK, "validate")["instance_id"], release=True)

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(finish, range(episodes)))
        flood.close()
        kept = _answers(lambda: innocent.evaluate(iid, release=True)) == verdict
    return {"episodes finished by the other client": episodes, INNOCENT_VERDICTS_LOST: int(not kept)}


#: An attack's figure: innocent verdicts it saw lost (counted as lost innocent episodes).
INNOCENT_VERDICTS_LOST = "innocent verdicts lost"
OUTSIDE_KILL_EVERY_S = 5.0  # room for the next spare to start between kills (a start takes ~2 s on an idle core)


def _outside_kills(client, stop) -> dict:
    """Worker processes SIGKILLed from outside the service (as the OOM killer or an operator would), one every
    ``OUTSIDE_KILL_EVERY_S`` while every worker and a spare are up, taking turns: no episode's doing, so none may be
    lost (issue "round 3", 3)."""
    import signal

    import requests

    kills = 0
    while not stop.wait(OUTSIDE_KILL_EVERY_S):
        workers = requests.get(client.url + "/health", timeout=30).json()["workers"]
        if workers["spare_pid"] is not None and all(row["alive"] for row in workers["per_worker"]):
            os.kill(workers["per_worker"][kills % workers["workers"]]["pid"], signal.SIGKILL)
            kills += 1
    return {"workers killed from outside": kills}


SLOW_EPISODES = 8
SLOW_DOUBLINGS = 13  # a find over 2**13 aliased entries: a fraction of the message budget, every time


def _slow_episodes_and_a_killer(client, stop) -> dict:
    """``SLOW_EPISODES`` episodes stepped in turn with messages that are slow but within budget (their replays add up
    to far more than ``replay_budget_s``), and every few rounds one episode whose message kills its worker: only
    that episode is lost, and each other episode's replay has its own budget (issue "round 3", 5)."""
    from env_service.client import EnvServiceError

    slow, killed, lost = [], 0, 0
    rounds = itertools.count()
    while not stop.is_set():
        slow = [iid for iid in slow if iid is not None]
        while len(slow) < SLOW_EPISODES:
            iid = client.create("multi_turn_base_0", "validate")["instance_id"]
            for message in aliasing_messages(SLOW_DOUBLINGS):
                client.step(iid, message)
            slow.append(iid)
        for k, iid in enumerate(slow):
            try:
                if client.step(iid, _call("find", path="."))["terminated"]:
                    client.release(iid)
                    slow[k] = None
            except EnvServiceError as error:
                if error.error != "episode_lost":
                    raise
                lost, slow[k] = lost + 1, None
        if next(rounds) % 3 == 0:
            killed += _killed_by_its_message(client)
    return {"worker kills by an episode's message": killed, "slow attacker episodes lost": lost}


def _killed_by_its_message(client) -> int:
    """One episode whose ``find`` over 2**40 aliased entries leaves its worker past the deadline (1 when killed)."""
    from env_service.client import EnvServiceError

    iid = client.create("multi_turn_base_0", "validate")["instance_id"]
    try:
        for message in aliasing_messages():
            client.step(iid, message)
        client.step(iid, _call("find", path="."))
    except EnvServiceError as error:
        if error.error != "episode_lost":
            raise
        return 1
    client.release(iid)
    return 0


# ---- Round 4 (issue 31): answers never read, abandoned requests, header abuse, kept bytes, CPU summed ----------

ANSWER_CONNECTIONS = 128
BIG_PROFILE = {"notes": "x" * (900 * 1024)}  # what GET /profile answers the attacker: ~900 KB for a cheap request


def _answers_never_read(client, stop) -> dict:
    """128 connections that each ask for a ~900 KB answer (``GET /profile`` of the attacker's run) and never read it:
    before, each kept its answer (and its connection) for good, in the service's buffers and the kernel's (24 such
    held 58 MiB of TCP memory 40 s later); now answers held share one budget (64 MiB) and a write timeout (30 s),
    the connections holding theirs the longest dropped first."""
    client.set_profile(BIG_PROFILE)
    request = b"GET /profile HTTP/1.1\r\nHost: answers\r\n%s: attacker\r\n\r\n" % RUN_ID_HEADER.encode()
    return _keep_sending(client, stop, ANSWER_CONNECTIONS, request, receive_buffer=4096)


def _raw_post(path: str, body: dict, *headers: str) -> bytes:
    data = json.dumps(body).encode()
    head = "".join(f"{header}\r\n" for header in headers)
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{head}Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def _abandoned_creates(client, stop) -> dict:
    """Creates whose client disconnects as soon as they are sent, from loopback like the innocent (one client for
    every per-address limit): before, each kept one of the address's requests in flight until it had run (the
    innocent's requests got 429 beyond 96), and the episode it made lived 600 s for no one."""
    import requests

    host, port = client.url.rsplit("/", 1)[-1].split(":")
    request = _raw_post("/create", {"task_id": PASSING_TASK, "mode": "validate"}, f"{RUN_ID_HEADER}: attacker")
    health = requests.get(client.url + "/health", timeout=30).json()
    sent = 0
    while not stop.is_set():
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(request)
        sent += 1
    time.sleep(1.0)  # what was under way has finished
    after = requests.get(client.url + "/health", timeout=30).json()
    return {
        "creates abandoned": sent,
        "episodes made and released at once": after["abandoned"] - health["abandoned"],
        "live episodes after (all clients)": after["live"],
    }


def _smuggled(secret: str | None) -> bytes:
    """A complete ``POST /profile`` of the anonymous run: were it ever read as a request, that profile would change."""
    return _raw_post("/profile", {"profile": {"smuggled": True}}, f"Authorization: Bearer {secret or 'none'}")


def header_abuse(secret: str | None = None) -> dict[str, bytes]:
    """Requests whose headers disagree on where a body ends or who sends it, fold lines, or are many and tiny
    (request smuggling, parser cost), each before any authentication; a smuggled request rides in each body."""
    auth = f"Authorization: Bearer {secret or 'none'}\r\n".encode()  # a service without a secret ignores it
    smuggled = _smuggled(secret)

    def request(headers: bytes, body: bytes = smuggled) -> bytes:
        return b"POST /release HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n" + headers + body

    release = b'Content-Length: 23\r\n\r\n{"instance_id": "ep_x"}'
    return {
        "two Content-Length": request(b"Content-Length: 5\r\nContent-Length: %d\r\n\r\n" % len(smuggled)),
        "the same Content-Length twice": request(b"Content-Length: 5\r\nContent-Length: 5\r\n\r\n"),
        "Content-Length then chunked": request(b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        "chunked then Content-Length": request(b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"),
        "a space before the colon": request(b"Transfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"),
        "chunked alone": request(b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        "a folded Content-Length": request(b"Content-Length: 0\r\n %d\r\n\r\n" % len(smuggled)),
        "a folded Transfer-Encoding": request(b"Content-Length: 5\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n"),
        "a folded header of no consequence": request(b"X-Note: a\r\n b\r\nContent-Length: 5\r\n\r\n"),
        "bare LF line ends": b"POST /release HTTP/1.1\nHost: x\n"
        + auth.replace(b"\r\n", b"\n")
        + b"Content-Length: 5\n\n"
        + smuggled,
        # well-formed but for a second copy of a header that says who sends the request (before: answered 200)
        "two run ids": request(b"X-Seal-Run-Id: a\r\nX-Seal-Run-Id: b\r\n" + release, b""),
        "two Authorization": request(b"Authorization: Bearer wrong\r\n" + release, b""),
        "two Host": request(b"Host: y\r\n" + release, b""),
        "many tiny headers": request(b"a:\r\n" * 16000 + b"Content-Length: 5\r\n\r\n"),
    }


def status_lines(host: str, port: int, data: bytes, timeout_s: float = 3.0) -> list[bytes]:
    """Every status line the server answers ``data`` with on a connection of its own, until it closes it (or
    ``timeout_s`` pass: a server that keeps it open took the request)."""
    import contextlib

    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(data)
        received = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    return [line for line in received.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def _header_abuse(client, stop) -> dict:
    """``header_abuse``'s requests, each on a connection of its own, over and over: each must get one 4xx and the
    connection closed, and no smuggled request may run."""
    host, port = client.url.rsplit("/", 1)[-1].split(":")
    sent = taken = 0
    while not stop.is_set():
        for data in header_abuse().values():
            statuses = status_lines(host, int(port), data)
            taken += len(statuses) != 1 or not statuses[0].split()[1].startswith(b"4")
            sent += 1
    with EnvClient(client.url, retries=0) as anonymous:
        smuggled_ran = anonymous.get_profile()["version"] != 0
    return {"abusive requests": sent, "taken as requests": taken, "smuggled requests run": int(smuggled_ran)}


#: A memory of many short entries (~0.9 MB of JSON): as Python objects it takes many times that.
MEMORY_SNAPSHOT = {"core_memory": {}, "archival_memory": {f"k{i}": f"note {i}" for i in range(40_000)}}
MEMORY_PREREQ = "memory_kv_prereq_33-notetaker-1"  # not its scenario's first: it hands back the memory it is given


def _memory_verdicts(client, stop) -> dict:
    """Memory prerequisites given ``MEMORY_SNAPSHOT``, evaluated and released, over and over: each verdict (kept for
    a retried evaluate) carries the memory. Before, each was kept as Python objects (~7 MiB), 2,048 a client; now as
    its JSON, within 64 MiB a client."""
    finished = 0
    while not stop.is_set():
        iid = client.create(MEMORY_PREREQ, "validate", memory_snapshot=MEMORY_SNAPSHOT)["instance_id"]
        client.evaluate(iid, release=True)
        finished += 1
    return {"memory verdicts kept for retries": finished}


CPU_BUDGET_S = 2.0  # the episode CPU budget of WORKER_ATTACKS' service, where the class below runs
CHEAP_DOUBLINGS = 16  # a find over 2**16 aliased entries: well within the call and message budgets, every time


def _cheap_calls_summed(client, stop) -> dict:
    """Episodes whose every message runs a ``find`` within every per-call and per-message budget, sent until each
    episode ends: with ``--episode-cpu-budget-s 2`` each ends after ~2 s of a worker's CPU; before, after
    ``max_steps`` messages (up to 100 message budgets of a worker)."""
    ended = messages = 0
    while not stop.is_set():
        iid = client.create("multi_turn_base_0", "validate")["instance_id"]
        for message in aliasing_messages(CHEAP_DOUBLINGS):
            client.step(iid, message)
        while not stop.is_set():
            reply = client.step(iid, _call("find", path="."))
            messages += 1
            if reply["terminated"]:
                ended += reply["info"]["error_type"] == "limit_exceeded"
                break
        client.release(iid)
    return {"attacker messages": messages, "attacker episodes ended by their CPU budget": ended}


PASSING_TASK = "multi_turn_base_2"
WEB_TASK = "web_search_base_0"
OOD_TASK = "memory_kv_prereq_32-notetaker-0"  # an OOD episode with a scratch folder


def _no_attack(client, stop) -> None:
    """Nothing: the innocent client alone, on the same service and machine as the attacks (their baseline)."""
    stop.wait()


#: The class that measures the innocent client alone: every other class's p99 is also given over its p99, and the
#: smoke test bounds what an attack adds to it (the innocent's own step time, which a loaded machine stretches, cancels).
ALONE = "no attack (the innocent alone)"

#: Attack class -> a client that keeps it up until told to stop, and may return figures of its own (issue "round 2":
#: nothing one client does costs another anything). Run on one service with a (fake) search key, after ``ALONE``.
ATTACKS = {
    ALONE: _no_attack,
    "deeply nested names": _deep_names,
    "parse-error floods": _parse_floods,
    "refused-call floods": _refused_call_floods,
    "guessed and reused ids": _guessed_ids,
    "80 requests queued on one episode": _busy_queue,
    "16 episodes with budget-busting messages queued": _busy_episodes,
    "one episode's long messages in bursts": _long_messages_in_bursts,
    "minted run ids": _minted_run_ids,
    "connection hoarding": _connection_hoard,
    "slow bodies from loopback addresses": _slow_bodies,
    "web fetches of loopback addresses": _forged_fetches,
    "pipelined requests never read": _pipelined_requests,
    "2 MiB bodies that never finish": _bodies_in_flight,
    "4 run ids of one client fill the service": _run_ids_fill_the_service,
    "another client finishes more episodes than a client keeps": _finished_episodes_flood,
    "answers never read": _answers_never_read,
    "creates abandoned by their client": _abandoned_creates,
    "header abuse before authentication": _header_abuse,
    "memory verdicts kept for retries": _memory_verdicts,
}
#: Attacks that need a service of their own (flags): workers killed by an episode, or from outside.
WORKER_ATTACKS = {
    "its episode kills its worker": _kills_its_worker,
    "workers killed from outside": _outside_kills,
    "slow episodes beside a killed worker": _slow_episodes_and_a_killer,
    # on the same service, whose episodes have a small CPU budget (``CPU_BUDGET_S``): the slow episodes above end by it
    # now and then and are replaced, which changes nothing they measure
    "an episode's many cheap calls": _cheap_calls_summed,
}


def _innocent_replays(url: str, ids: list[str], min_s: float, resident: int = 4) -> tuple[list[float], int, list[str]]:
    """GT replays of ``ids`` (cycled for at least ``min_s``), ``resident`` episodes live at a time and stepped in
    turn, so that some live on every worker: (step latencies, episodes valid, why each lost or failed one was)."""
    latencies, valid, lost, started = [], 0, [], time.monotonic()
    cycle = itertools.cycle(ids)
    with EnvClient(url, retries=0, timeout_s=120, run_id="innocent") as client:
        while time.monotonic() - started < min_s or not latencies:
            live = {}
            for task_id in itertools.islice(cycle, resident):
                try:
                    iid = client.create(task_id, "validate")["instance_id"]
                except Exception as error:  # noqa: BLE001 - counted: an innocent episode must never fail
                    lost.append(repr(error)[:300])
                    continue
                live[iid] = replay.ground_truth_messages(tasks.load_task(task_id))
            for turn in range(max((len(m) for m in live.values()), default=0)):
                for iid, messages in list(live.items()):
                    if turn >= len(messages):
                        continue
                    step_started = time.perf_counter()
                    try:
                        client.step(iid, messages[turn])
                    except Exception as error:  # noqa: BLE001 - counted
                        lost.append(repr(error)[:300])
                        del live[iid]
                        continue
                    latencies.append(time.perf_counter() - step_started)
            for iid in live:
                try:
                    valid += client.evaluate(iid, release=True)["valid"]
                except Exception as error:  # noqa: BLE001 - counted
                    lost.append(repr(error)[:300])
    return latencies, valid, lost


def _p99(latencies: list[float]) -> float:
    latencies = sorted(latencies)
    return latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("inf")


def _innocent_during(service: ServiceProcess, attack, ids: list[str], min_s: float) -> dict:
    """The innocent client's replays of ``ids`` (for at least ``min_s``) while ``attack`` runs on another client."""
    stop, errors, extra = threading.Event(), [], {}

    def attacker() -> None:
        with EnvClient(service.url, retries=0, timeout_s=120, run_id="attacker") as client:
            try:
                extra.update(attack(client, stop) or {})
            except Exception as error:  # noqa: BLE001 - a refusal ends the attack, which is fine
                errors.append(repr(error)[:200])

    rss_before, main_before = service.rss_mib(), service.rss_mib(workers=False)
    thread = threading.Thread(target=attacker)
    thread.start()
    time.sleep(1.0)  # the attack is under way
    latencies, valid, lost = _innocent_replays(service.url, ids, min_s)
    rss_after, main_after = service.rss_mib(), service.rss_mib(workers=False)
    stop.set()
    thread.join(120)
    lost += ["a verdict kept for its retry was lost"] * extra.get(INNOCENT_VERDICTS_LOST, 0)  # seen by the attack
    p99 = _p99(latencies)
    return {
        "p99_s": p99,
        "p99_over_budget": p99 / HOSTILE_BUDGET_S,
        "max_s": max(latencies, default=float("inf")),  # the one step a rare long wait hits (a p99 may not see it)
        "innocent_valid": valid,
        "innocent_episodes": valid + len(lost),
        "innocent_lost": len(lost),
        "innocent_lost_first": lost[0] if lost else None,
        "rss_growth_mib": rss_after - rss_before,
        "main_rss_growth_mib": main_after - main_before,  # the HTTP layer's own (connections, bodies)
        "attack_stopped_by": errors[0] if errors else None,  # a refusal that ended the attack early
        "attack_figures": extra,
        "ok": not lost and valid > 0 and p99 <= LATENCY_TARGET * HOSTILE_BUDGET_S,
    }


def innocent_under_attacks(
    task_ids: list[str],
    min_s: float,
    worker_kills: int,
    only: str | None = None,
    quick: bool = False,
    service_flags: tuple[str, ...] = (),
) -> dict:
    """Per attack class: an innocent client's GT replays while the class runs (step p99 against the message
    budget, episodes lost or failed) and how much the service and its workers grew; then a stopped worker.
    ``only``: that class alone (no stopped worker). ``quick``: the verdict flood scaled down with what a client keeps.
    ``service_flags``: more flags of the services the attacks run on."""
    from env_service.bfcl.ood_tasks import SERPAPI_KEY_ENV

    flags = ("--workers", "2", "--message-budget-s", str(HOSTILE_BUDGET_S), "--call-budget-s", str(HOSTILE_BUDGET_S))
    flags += service_flags
    attacks, worker_attacks = _chosen(ATTACKS, only), _chosen(WORKER_ATTACKS, only)
    if attacks:  # the baseline first, on the same service
        attacks = {ALONE: ATTACKS[ALONE], **attacks}
    if quick:
        flags += ("--evaluations-kept-per-client", str(QUICK_KEPT_PER_CLIENT))
        attacks = {
            name: functools.partial(attack, episodes=QUICK_FLOOD_EPISODES)
            if attack is _finished_episodes_flood
            else attack
            for name, attack in attacks.items()
        }
    ids = [t for t in task_ids if t not in replay.EXPECTED_FAILURES]
    fake_key = {SERPAPI_KEY_ENV: "not-a-real-key"}  # the fetch needs no search; nothing leaves the machine
    figures, stopped = {}, {}
    if attacks:
        with ServiceProcess(*flags, env=fake_key) as service:
            figures = _each_class(service, attacks, ids, min_s)
            if only is None:
                stopped["stopped_worker"] = stopped_worker(service, ids, worker_kills)
                progress("a stopped worker")
    if worker_attacks:
        # No grace, and room for the find to run into its time budget rather than its memory budget: each such
        # message leaves its worker past the deadline, so the worker is killed (and its innocent episodes rebuilt).
        worker_flags = (
            "--worker-grace-s",
            "0",
            "--call-memory-mib",
            "4096",
            "--episode-cpu-budget-s",
            str(CPU_BUDGET_S),
        )
        with ServiceProcess(*flags, *worker_flags) as service:
            figures.update(_each_class(service, worker_attacks, ids, min_s))
    alone = figures.get(ALONE, {}).get("p99_s")
    for figure in [*figures.values(), *stopped.values()]:
        figure["p99_over_alone"] = figure["p99_s"] / alone if alone else None
    return {"classes": figures, **stopped}


def _each_class(service: ServiceProcess, attacks: dict, ids: list[str], min_s: float) -> dict:
    figures = {}
    for name, attack in attacks.items():
        figures[name] = _innocent_during(service, attack, ids, min_s)
        progress(f"attack class: {name}")
    return figures


def _chosen(classes: dict, only: str | None) -> dict:
    return {name: attack for name, attack in classes.items() if only in (None, name)}


#: Creates ``_placed_on`` and ``_beside`` may make before they give up: each is retried only on a condition that
#: passes by itself (another client's episode count changing at the same moment; a worker calming down).
PLACEMENT_TRIES = 64


def _placed_on(service: ServiceProcess, create, release) -> tuple[str, int]:
    """``create()``'s instance id and the index of the worker it landed on: the one whose episode count grew by one
    while no other count changed. Episodes of other clients may come and go meanwhile (an attack's leftovers released
    late, the idle reclaim), which a before/after count cannot tell apart from ours: such a create is released and
    made again, never guessed (taking the first count that grew named the wrong worker, or none: StopIteration)."""
    for _ in range(PLACEMENT_TRIES):
        before = [w["episodes"] for w in service.workers()]
        iid = create()
        after = [w["episodes"] for w in service.workers()]
        changed = [i for i, (b, a) in enumerate(zip(before, after)) if a != b]
        if len(changed) == 1 and after[changed[0]] == before[changed[0]] + 1:
            return iid, changed[0]
        release(iid)
    raise RuntimeError(f"no create of {PLACEMENT_TRIES} could be told apart from other clients' episodes")


def _beside(service: ServiceProcess, create, release, worker: int) -> tuple[str, int]:
    """An episode on another worker than ``worker``: ``(instance id, its worker)``.

    The service places a new episode on the calm worker (busy less than half of its last ``BUSY_WINDOW_S``) with the
    fewest episodes, so right after an attack that kept the other worker busy, or left episodes on it, every create
    may land on ``worker`` (before, 20 tries that each released their episode ended with the released one stepped:
    404 on a loaded machine). The episodes that land on ``worker`` are kept until one lands elsewhere, so its count
    grows past the other's, and each retry waits a tenth of the window, within which a worker left idle calms."""
    from env_service.workers.pool import BUSY_WINDOW_S

    kept = []
    try:
        for _ in range(PLACEMENT_TRIES):
            iid, placed = _placed_on(service, create, release)
            if placed != worker:
                return iid, placed
            kept.append(iid)
            time.sleep(BUSY_WINDOW_S / 10)
        raise RuntimeError(f"{PLACEMENT_TRIES} creates in a row landed on worker {worker}")
    finally:
        for iid in kept:
            release(iid)


def _replaced(service: ServiceProcess, worker: int, restarts: int) -> None:
    """Wait (bounded) until ``worker`` was replaced after ``restarts`` restarts (the service sees the exit at once)."""
    deadline = time.monotonic() + 120
    while service.workers()[worker]["restarts"] <= restarts and time.monotonic() < deadline:
        time.sleep(0.05)


def _scratch_counts(service: ServiceProcess) -> tuple[int, int]:
    """(worker folders, episode folders) in the service's scratch root."""
    import glob

    (root,) = glob.glob(os.path.join(tempfile.gettempdir(), f"seal-env-{service.proc.pid}-*"))
    workers = [os.path.join(root, d) for d in os.listdir(root)]
    return len(workers), sum(len(os.listdir(w)) for w in workers)


def _seconds_to_503(service: ServiceProcess, give_up_s: float = 30.0) -> float:
    """Seconds from now until a ``/health`` asked then answers 503 (``give_up_s`` if none does): the time the poll
    that got it was sent, so a slow answer on a loaded machine does not count as the service's delay."""
    import requests

    started = time.monotonic()
    while (asked := time.monotonic()) - started < give_up_s:
        if requests.get(service.url + "/health", timeout=30).status_code == 503:
            return asked - started
        time.sleep(0.05)
    return give_up_s


def stopped_worker(service: ServiceProcess, ids: list[str], kills: int) -> dict:
    """SIGSTOP the worker of one innocent episode: how long /health takes to say 503, and an innocent episode on
    the other worker meanwhile (GT replay, step p99); then SIGKILL it (its episode is rebuilt), and ``kills``
    more kills of a worker holding an OOD episode: how many scratch folders are left."""
    import signal

    task_id = ids[0]
    messages = replay.ground_truth_messages(tasks.load_task(task_id))
    with EnvClient(service.url, retries=0, timeout_s=120, run_id="innocent") as client:

        def create(task: str = task_id) -> str:
            return client.create(task, "validate")["instance_id"]

        victim, victim_worker = _placed_on(service, create, client.release)
        other, _ = _beside(service, create, client.release, victim_worker)
        row = service.workers()[victim_worker]
        pid = row["pid"]
        os.kill(pid, signal.SIGSTOP)
        detected_s = _seconds_to_503(service)
        latencies, valid = [], 0
        for message in messages:
            step_started = time.perf_counter()
            client.step(other, message)
            latencies.append(time.perf_counter() - step_started)
        valid += client.evaluate(other, release=True)["valid"]
        os.kill(pid, signal.SIGKILL)
        _replaced(service, victim_worker, row["restarts"])
        try:
            for message in messages:  # the stopped worker's innocent episode, rebuilt on its replacement
                client.step(victim, message)
            valid += client.evaluate(victim, release=True)["valid"]
        except Exception:  # noqa: BLE001 - counted below: lost
            pass
        for _ in range(kills):
            ood, worker = _placed_on(service, lambda: create(OOD_TASK), client.release)
            row = service.workers()[worker]
            os.kill(row["pid"], signal.SIGKILL)
            _replaced(service, worker, row["restarts"])
            client.release(ood)
        worker_folders, episode_folders = _scratch_counts(service)
    p99 = _p99(latencies)
    return {
        "health_503_after_s": detected_s,
        "p99_s": p99,
        "p99_over_budget": p99 / HOSTILE_BUDGET_S,
        "innocent_valid": valid,
        "innocent_episodes": 2,
        "innocent_lost": 2 - valid,
        "worker_kills": kills + 1,
        "scratch_worker_folders": worker_folders,
        "scratch_episode_folders": episode_folders,
        "ok": valid == 2 and detected_s < 5 and p99 <= LATENCY_TARGET * HOSTILE_BUDGET_S and episode_folders == 0,
    }


def memory_run(task_ids: list[str], first: int, total: int, concurrency: int) -> dict:
    """RSS of a fresh service after ``first`` and after ``total`` GT episodes (tasks cycled)."""
    cycle = list(itertools.islice(itertools.cycle(task_ids), total))
    with ServiceProcess() as service, EnvClient(service.url, pool_size=concurrency) as client:
        rss_start = service.rss_mib()
        a = replay.replay_split(client, cycle[:first], concurrency=concurrency)
        rss_first = service.rss_mib()
        b = replay.replay_split(client, cycle[first:], concurrency=concurrency)
        rss_total = service.rss_mib()
        live = client.health()["live"]
    ok = replay.summarize(a + b)["ok"]
    return {
        "start_mib": rss_start,
        "first": first,
        "first_mib": rss_first,
        "total": total,
        "total_mib": rss_total,
        "ratio": rss_total / rss_first,
        "live_after": live,
        "ok": ok,
    }


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


_STARTED = time.monotonic()


def progress(what: str) -> None:
    """One line on stderr per phase done, with the seconds since the start: a run that takes long shows where."""
    print(f"[env_service benchmark +{time.monotonic() - _STARTED:.0f} s] {what}", file=sys.stderr, flush=True)


def run(quick: bool, only: str | None = None, service_flags: tuple[str, ...] = ()) -> dict:
    task_ids = tasks.task_ids("heldout")
    if quick:
        task_ids = task_ids[::25]  # 16 tasks, all four categories
    mem_first, mem_total = (50, 200) if quick else (500, 5000)
    attack_ids, attack_s, worker_kills = (task_ids[:2], 3, 3) if quick else (task_ids[::25], 20, 10)
    if only:  # one attack class alone
        return {
            "tasks": len(task_ids),
            "attacks": innocent_under_attacks(attack_ids, attack_s, worker_kills, only, quick, service_flags),
        }

    InProcessEnvClient().health()
    replay.replay_split(InProcessEnvClient(), task_ids[:8])  # warm-up: imports, task cache, method tables
    figures = {"tasks": len(task_ids), "in_process": timed_replay(InProcessEnvClient(), task_ids, 1)}
    progress("in-process replay")
    with ServiceProcess() as service:
        for concurrency in (1, 32):
            with EnvClient(service.url, pool_size=concurrency) as client:
                figures[f"http_c{concurrency}"] = timed_replay(client, task_ids, concurrency)
    progress("HTTP replays")
    figures.update(workers_scaling(task_ids))
    progress("--workers 1 and 2")
    figures["bare_checker"] = bare_checker(task_ids)
    figures["hostile"] = hostile_neighbour(task_ids[::10] if quick else task_ids[::4])
    progress("bare checker, hostile neighbour")
    figures["attacks"] = innocent_under_attacks(
        attack_ids, attack_s, worker_kills, quick=quick, service_flags=service_flags
    )
    figures["memory"] = memory_run(task_ids, mem_first, mem_total, concurrency=32)
    progress("memory run")
    inproc, http32 = figures["in_process"]["eps"], figures["http_c32"]["eps"]
    figures["ratios"] = {
        "http32_over_in_process": http32 / inproc,
        "slowdown_http32": inproc / http32,
        "in_process_over_bare": inproc / figures["bare_checker"]["eps"],
        "workers_2_over_1": figures["workers_2"]["eps"] / figures["workers_1"]["eps"],
    }
    return figures


def report(figures: dict) -> str:
    rows = [
        ("in-process (1 thread)", figures["in_process"]),
        ("HTTP, concurrency 1", figures["http_c1"]),
        ("HTTP, concurrency 32", figures["http_c32"]),
        ("HTTP@32, --workers 1", figures["workers_1"]),
        ("HTTP@32, --workers 2", figures["workers_2"]),
        ("bare bfcl multi_turn_checker", figures["bare_checker"]),
    ]
    lines = [
        f"GT replay of {figures['tasks']} held-out tasks "
        f"(create + steps + evaluate + release per episode; cpus={os.cpu_count()})",
        "",
        f"{'path':<32}{'episodes':>9}{'seconds':>10}{'episodes/s':>12}{'passed':>8}",
    ]
    for name, r in rows:
        lines.append(f"{name:<32}{r['episodes']:>9}{r['seconds']:>10.2f}{r['eps']:>12.1f}{r['passed']:>8}")
    ratios, mem, hostile = figures["ratios"], figures["memory"], figures["hostile"]
    slow_ok = ratios["slowdown_http32"] <= SLOWDOWN_TARGET
    mem_ok = mem["ratio"] <= MEMORY_TARGET
    scaling_ok = ratios["workers_2_over_1"] >= WORKER_SCALING_TARGET
    latency_ok = hostile["p99_over_budget"] <= LATENCY_TARGET
    lines += [
        "",
        f"HTTP@32 / in-process throughput : {ratios['http32_over_in_process']:.2f} "
        f"(slowdown {ratios['slowdown_http32']:.2f}x; target <= {SLOWDOWN_TARGET:.0f}x: "
        f"{'MET' if slow_ok else 'MISSED'})",
        f"in-process / bare checker       : {ratios['in_process_over_bare']:.2f} "
        f"(bare checker is {1 / ratios['in_process_over_bare']:.1f}x faster: it skips parsing, turns, "
        f"isolation and tags)",
        f"--workers 2 / --workers 1 (HTTP@32)  : {ratios['workers_2_over_1']:.2f} "
        f"(target >= {WORKER_SCALING_TARGET} on 2 idle cores: {'MET' if scaling_ok else 'MISSED'})",
        "",
        f"hostile neighbour ({hostile['hostile_messages']} budget-busting messages, mean "
        f"{hostile['hostile_mean_s']:.2f} s each, message budget {hostile['budget_s']:g} s): innocent step "
        f"p50 {hostile['p50_s'] * 1000:.0f} ms, p99 {hostile['p99_s']:.2f} s = {hostile['p99_over_budget']:.2f}x "
        f"the budget (target <= {LATENCY_TARGET:g}x: {'MET' if latency_ok else 'MISSED'}), "
        f"worst {hostile['max_s']:.2f} s "
        f"(new episodes avoid the hogged worker; one already there waits behind one message); innocent episodes "
        f"valid {hostile['innocent_valid']}/{hostile['innocent_episodes']}; worker restarts "
        f"{hostile['worker_restarts']}",
        "",
        attacks_report(figures["attacks"]),
        "",
        f"service RSS: start {mem['start_mib']:.1f} MiB, after {mem['first']} episodes {mem['first_mib']:.1f} MiB, "
        f"after {mem['total']} episodes {mem['total_mib']:.1f} MiB",
        f"RSS ratio {mem['total']}/{mem['first']}: {mem['ratio']:.3f} "
        f"(target <= {MEMORY_TARGET}: {'MET' if mem_ok else 'MISSED'}); live episodes after: {mem['live_after']}",
    ]
    return "\n".join(lines)


def attacks_report(attacks: dict) -> str:
    """The innocent client's figures per attack class (and with a stopped worker, when measured)."""
    lines = [
        "innocent client per attack class (GT replays, 4 episodes live at a time, while the class runs; message "
        f"budget {HOSTILE_BUDGET_S:g} s, target p99 <= {LATENCY_TARGET:g}x the budget, none lost; in brackets the p99 "
        "over the innocent's alone):",
        *(_attack_line(name, a) for name, a in attacks["classes"].items()),
    ]
    if "stopped_worker" in attacks:
        lines.append(_stopped_worker_line(attacks["stopped_worker"]))
    return "\n".join(lines)


def _over_alone(a: dict) -> str:
    ratio = a.get("p99_over_alone")
    return f" ({ratio:.1f}x alone)" if ratio is not None else ""


def _attack_line(name: str, a: dict) -> str:
    extra = "".join(f", {key} {value}" for key, value in a["attack_figures"].items())
    return (
        f"  {name:<36} p99 {a['p99_s']:.2f} s = {a['p99_over_budget']:.2f}x{_over_alone(a)}, max {a['max_s']:.2f} s, "
        f"valid "
        f"{a['innocent_valid']}/{a['innocent_episodes']}, lost {a['innocent_lost']}, service+workers RSS "
        f"{a['rss_growth_mib']:+.0f} MiB (service {a['main_rss_growth_mib']:+.0f} MiB){extra}: {'MET' if a['ok'] else 'MISSED'}"
        + (f" (attack ended by {a['attack_stopped_by']})" if a["attack_stopped_by"] else "")
        + (f" (first lost: {a['innocent_lost_first']})" if a["innocent_lost_first"] else "")
    )


def _stopped_worker_line(s: dict) -> str:
    return (
        f"  {'a stopped (SIGSTOP) worker':<36} /health 503 after {s['health_503_after_s']:.2f} s; innocent episode "
        f"on the other worker p99 {s['p99_s']:.2f} s = {s['p99_over_budget']:.2f}x{_over_alone(s)}; valid "
        f"{s['innocent_valid']}/{s['innocent_episodes']} (the stopped worker's own episode rebuilt after its kill), "
        f"lost {s['innocent_lost']}; after {s['worker_kills']} worker kills (OOD episodes on them) scratch folders "
        f"left: {s['scratch_episode_folders']} episode, {s['scratch_worker_folders']} worker: "
        f"{'MET' if s['ok'] else 'MISSED'}"
    )


#: One tree's HTTP@32 replay of the held-out split, run in that tree (``side_by_side``): best of two after a warm-up.
_ONE_TREE = r"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("tree_benchmark", "benchmarks/env_service.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
ids = bench.tasks.task_ids("heldout")
with bench.ServiceProcess() as service, bench.EnvClient(service.url, pool_size=32) as client:
    bench.replay.replay_split(client, ids[:16], concurrency=8)
    runs = [bench.timed_replay(client, ids, 32) for _ in range(2)]
print(json.dumps({"eps": max(r["eps"] for r in runs), "ok": all(r["ok"] for r in runs)}))
"""


def side_by_side(other: str, rounds: int) -> dict:
    """HTTP@32 episodes/s of this tree and of ``other`` (another checkout, e.g. ``git worktree add /tmp/base REV``),
    alternating ``rounds`` times in one run, so both see the same machine load."""
    trees = {"this tree": str(REPO), "other tree": str(Path(other).resolve())}
    eps: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, "-c", _ONE_TREE], cwd=tree, env=env, capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            if not result["ok"]:
                raise RuntimeError(f"{name}'s replay had errors")
            eps[name].append(result["eps"])
            print(f"  {name}: HTTP@32 {result['eps']:.1f} episodes/s", flush=True)
    means = {name: statistics.mean(values) for name, values in eps.items()}
    return {"eps": eps, "means": means, "ratio": means["this tree"] / means["other tree"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 tasks, memory after 50 vs 200 episodes")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    classes = [*ATTACKS, *WORKER_ATTACKS]
    parser.add_argument(
        "--only",
        choices=classes,
        metavar="CLASS",
        help="measure only this attack class of the innocent-client run (5.), one of: " + "; ".join(classes),
    )
    parser.add_argument(
        "--side-by-side",
        metavar="OTHER_TREE",
        help="only compare HTTP@32 throughput with another checkout (e.g. git worktree add /tmp/base REV), alternating",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternations of --side-by-side (3)")
    parser.add_argument(
        "--move-after-s",
        type=float,
        help="the attack services' --move-after-s (default: the service's; 0: episodes never move, as before round 7)",
    )
    args = parser.parse_args(argv)
    if args.side_by_side:
        compared = side_by_side(args.side_by_side, args.rounds)
        print(
            f"HTTP@32 mean: this tree {compared['means']['this tree']:.1f}, other tree "
            f"{compared['means']['other tree']:.1f} episodes/s; this / other {compared['ratio']:.3f}"
        )
        return 0
    service_flags = () if args.move_after_s is None else ("--move-after-s", str(args.move_after_s))
    figures = run(args.quick, args.only, service_flags)
    print(attacks_report(figures["attacks"]) if args.only else report(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.only:
        return 0 if all(a["innocent_lost"] == 0 for a in figures["attacks"]["classes"].values()) else 1
    replays_ok = all(
        figures[k]["ok"] for k in ("in_process", "http_c1", "http_c32", "workers_1", "workers_2", "hostile", "memory")
    )
    return 0 if replays_ok else 1


if __name__ == "__main__":
    sys.exit(main())
