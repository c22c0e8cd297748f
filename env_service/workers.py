"""Episodes in worker processes: every core busy, time budgets that can interrupt, and hangs contained.

Backend work is CPU-bound Python, so one process runs one call at a time whatever the threads. The
:class:`WorkerPool` starts ``n`` processes (``python -m env_service.workers FD``, talking pickles over a
socket pair: nothing of the service's threaded process is forked, and no caller's main module is re-run,
as multiprocessing's spawn would); each loads the task table once (about 2 s) and
then holds whole :class:`~env_service.episode.Episode` objects — backends, turn records, the verifier's replay
at evaluate — keyed by the manager's instance id. An episode stays on the worker that created it, because
its backend state lives there. A new episode goes to the worker with the fewest episodes among those busy
less than half of the last ``BUSY_WINDOW_S`` (all of them when none is): a worker that a hostile client keeps
busy with budget-exhausting messages gets no new episodes while another one has room.

Inside a worker, calls run on the main thread, where the episode's time budgets interrupt them
(:func:`~env_service.executor.time_limit`). The parent waits for each answer at most the request's budget
plus ``worker_grace_s``; a worker that does not answer by then (work a timer cannot interrupt, a crash, the
memory cap) is killed and replaced. Only the episode whose request it died on fails, with :class:`WorkerLost`:
the other episodes it held are rebuilt on the replacement by replaying their messages (each reply checked
against the one the client got; within ``replay_budget_s``), so a worker loss is invisible to them. Requests
to one worker are serialised in the parent by a :class:`~env_service.fair_gate.FairGate`, so the pipe carries one
request at a time, and a waiting request of the owner that used the workers least lately goes first: an owner that
keeps many budget-busting messages queued delays its own requests, not another owner's.

The replacement is a spare: one more process, started (and its imports and task table loaded) long before it is
needed, that holds no episode until a kill hands it the dead worker's place; the next spare starts once the innocent
episodes are rebuilt. Without it they waited for a cold start (seconds on a loaded machine) before their replay.
The spare is one idle process (about one worker's base memory, under the same ``worker_memory_mib`` cap, no CPU);
``/health`` names its pid, and it stops with the pool.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from env_service import tasks
from env_service.config import ServiceLimits
from env_service.fair_gate import FairGate, Usage
from env_service.ood_episode import load_any_task, new_episode
from env_service.parent_watch import exit_with_parent
from env_service.scratch import SCRATCH_ENV, make_scratch_root

log = logging.getLogger(__name__)

#: How long a new worker may take to import bfcl-eval and load the task table.
START_TIMEOUT_S = 120.0
#: How long a request waits for its worker while the worker serves other episodes.
QUEUE_TIMEOUT_S = 300.0
#: Budget of requests that do no backend work (create, close), on top of ``worker_grace_s``.
SHORT_REQUEST_S = 10.0
#: The window over which a worker's busy share is measured when placing new episodes.
BUSY_WINDOW_S = 5.0
#: A worker's heartbeat thread beats this often; a worker silent for HEARTBEAT_TIMEOUT_S is not answering
#: (stopped, or stuck in C code that holds the interpreter), whatever it is doing.
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 2.0
_BEAT = struct.Struct("d")  # one beat: the worker's time.monotonic() (system-wide on Linux)


class WorkerLost(Exception):
    """The worker that held an episode died or was killed; the episode is gone."""


class _ReplacedBeforeSent(WorkerLost):
    """The worker was replaced while a request waited for it; the request was never sent."""


class WorkerBusy(Exception):
    """The episode's worker stayed busy with other episodes for longer than ``QUEUE_TIMEOUT_S``."""


class RemoteError(Exception):
    """An exception inside the worker other than ValueError (a bug); ``kind`` is its class name."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


# ---------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------


def _limit_memory(mib: int) -> None:
    if mib > 0:
        import resource

        cap = mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _beat_forever(beats: socket.socket) -> None:
    """The worker's heartbeat (a daemon thread): it needs the interpreter, so a stopped or stuck worker goes silent."""
    beats.setblocking(False)
    while True:
        with contextlib.suppress(BlockingIOError):  # the parent reads continuously; a full buffer is a missed beat
            beats.send(_BEAT.pack(time.monotonic()))
        time.sleep(HEARTBEAT_INTERVAL_S)


def _worker_main(conn, beats: socket.socket) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the service, which then stops us
    exit_with_parent(os.getppid())  # a killed service too (gone before this line: the recv below meets EOF)
    threading.Thread(target=_beat_forever, args=(beats,), name="heartbeat", daemon=True).start()
    limits: ServiceLimits = conn.recv()
    ids = tasks.task_ids("all")
    tasks.load_task(ids[0])  # the whole table, once
    _limit_memory(limits.worker_memory_mib)
    episodes: dict[str, Any] = {}
    conn.send(("ready", os.getpid()))
    while True:
        try:
            op, key, args = conn.recv()
        except (EOFError, OSError):  # the service is gone
            return
        try:
            reply = (True, _handle(episodes, limits, op, key, args))
        except ValueError as error:
            reply = (False, ("ValueError", str(error)[:2000]))
        except Exception as error:  # noqa: BLE001 - reported to the parent, which logs it
            log.exception("worker %d: %s of %s failed", os.getpid(), op, key)
            reply = (False, (type(error).__name__, str(error)[:2000]))
        conn.send(reply)


def _handle(episodes: dict, limits: ServiceLimits, op: str, key: str, args: tuple):
    if op == "create":
        task_id, mode, config, profile, memory_snapshot = args
        episode = new_episode(load_any_task(task_id), mode, config, profile, limits, memory_snapshot)
        messages = episode.initial_messages()
        episodes[key] = episode
        return messages, episode.info
    if op == "step":
        return episodes[key].step(*args)  # a StepResult (a plain dataclass: it pickles)
    if op == "evaluate":
        return episodes[key].evaluate(*args)
    if op == "close":
        episode = episodes.pop(key, None)
        if episode is not None:
            episode.close()
        return None
    raise ValueError(f"unknown worker request {op!r}")


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    process: Any = None
    conn: Any = None
    generation: int = 0
    gate: FairGate | None = None  # one request at a time, lightest owner first (the spare has none: it takes a place)
    busy_since: float | None = None
    recent: deque = field(default_factory=deque)  # (end, seconds busy) of requests in the last window
    busy_deadline_s: float = 0.0
    episodes: dict = field(default_factory=dict)  # key -> its RemoteEpisode (None while being created)
    restarts: int = 0
    beats: Any = None  # our end of the heartbeat socket
    last_beat: float = 0.0  # time.monotonic() of the worker's last heartbeat
    scratch: str = ""  # the process's scratch folder, named when it was launched (a spare's before it had a place)


class WorkerPool:
    """``n`` worker processes holding episodes; see the module docstring."""

    def __init__(self, n: int, limits: ServiceLimits):
        if n < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.limits = limits
        self.usage = Usage()  # each owner's recent worker seconds, which orders the requests waiting for a worker
        self._workers = [_Worker(i, gate=FairGate(self.usage)) for i in range(n)]
        self._state = threading.Lock()  # guards episode sets and the started flag
        self._started = False
        self._monitor = _HeartbeatMonitor()
        self.scratch = make_scratch_root()
        self._launches = itertools.count()  # names each process's scratch folder
        self._spare: _Worker | None = None  # launched, ready or nearly, holding no episode (see the module docstring)
        self._spare_lock = threading.Lock()  # guards _spare (two workers may be killed at once)

    def __len__(self) -> int:
        return len(self._workers)

    def start(self) -> None:
        with self._state:
            if self._started:
                return
            self._started = True
        for worker in self._workers:  # all start at once; then wait for each
            self._launch(worker)
        for worker in self._workers:
            self._await_ready(worker)
        self._launch_spare()  # after the workers: it must not slow their start

    def _spawn(self, worker: _Worker) -> None:
        self._launch(worker)
        self._await_ready(worker)

    def _launch_spare(self) -> None:
        """Start the next spare, without waiting for it (its "ready" waits in the socket until it is taken). A spare
        only saves time: one that cannot start is logged, and the next kill starts its replacement cold."""
        with self._spare_lock:
            if self._started and self._spare is None:  # not once close() has begun: it would outlive the pool
                spare = _Worker(index=-1)
                try:
                    self._launch(spare)
                except OSError as error:
                    log.warning("could not start a spare env worker: %s", error)
                    return
                self._spare = spare

    def _take_spare(self, worker: _Worker) -> bool:
        """Give ``worker`` (its old process retired) the spare's process; False when there is no usable spare (the pool
        is closing, or the spare died), and the caller starts one cold."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return False
        spare.index = worker.index  # for _await_ready's messages
        try:
            self._await_ready(spare)  # at once, unless kills come faster than a start
            if spare.process.poll() is not None:  # ready long ago, dead since (the OOM killer, an operator)
                raise RuntimeError(f"it exited with code {spare.process.returncode} after its start")
        except RuntimeError as error:
            log.warning("the spare env worker is unusable (%s); starting a replacement cold", error)
            self._retire(spare)
            return False
        self._monitor.forget(spare.beats)
        worker.process, worker.conn, worker.beats = spare.process, spare.conn, spare.beats
        worker.scratch, worker.last_beat = spare.scratch, time.monotonic()
        self._monitor.watch(worker)
        return True

    def _launch(self, worker: _Worker) -> None:
        ours, theirs = socket.socketpair()
        beats_ours, beats_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        package_root = str(Path(__file__).resolve().parents[1])
        scratch = os.path.join(self.scratch, f"worker-{next(self._launches)}")
        os.makedirs(scratch)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
            SCRATCH_ENV: scratch,
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "env_service.workers", str(theirs.fileno()), str(beats_theirs.fileno())],
            pass_fds=[theirs.fileno(), beats_theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        beats_theirs.close()
        conn = Connection(ours.detach())
        conn.send(self.limits)
        worker.process, worker.conn, worker.beats, worker.scratch = process, conn, beats_ours, scratch
        worker.last_beat = time.monotonic()  # start-up counts as alive until the first beat is due
        self._monitor.watch(worker)

    def _retire(self, worker: _Worker) -> None:
        """Kill ``worker``'s process if it still runs and let go of it: its sockets, heartbeat and scratch folder."""
        if worker.beats is not None:
            self._monitor.forget(worker.beats)
            worker.beats.close()
            worker.beats = None
        if worker.process is not None and worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait()
        if worker.conn is not None:
            worker.conn.close()  # kept: a request sent on it before a replacement takes its place fails as on a dead one
        if worker.scratch:
            shutil.rmtree(worker.scratch, ignore_errors=True)  # what its episodes left behind
            worker.scratch = ""

    def _await_ready(self, worker: _Worker) -> None:
        process, conn = worker.process, worker.conn
        if not conn.poll(START_TIMEOUT_S):
            process.kill()
            process.wait()
            raise RuntimeError(f"env worker {worker.index} did not start within {START_TIMEOUT_S:.0f} s")
        try:
            conn.recv()  # ("ready", pid)
        except EOFError:
            raise RuntimeError(
                f"env worker {worker.index} exited during start-up (exit code {process.wait()}); see its log above"
            ) from None

    def _kill(self, worker: _Worker, why: str, offender: str | None = None) -> None:
        """Kill and replace ``worker`` (its gate held). The episodes it held but ``offender`` (the one whose request
        it died on) are rebuilt on the replacement by replaying their messages (see ``_replay``)."""
        log.error(
            "env worker %d (pid %s): %s; killing it and starting a replacement (%d episodes on it)",
            worker.index,
            worker.process.pid,
            why,
            len(worker.episodes),
        )
        self._retire(worker)
        with self._state:
            innocents = [h for k, h in worker.episodes.items() if k != offender and h is not None and h.replayable]
            worker.episodes.clear()
        worker.generation += 1
        worker.restarts += 1
        if not self._take_spare(worker):
            self._spawn(worker)
        deadline = time.monotonic() + self.limits.replay_budget_s
        for handle in innocents:
            self._replay(worker, handle, deadline)
        self._launch_spare()  # after the replays, whose steps its start-up would slow

    def _replay(self, worker: _Worker, handle: RemoteEpisode, deadline: float) -> None:
        """Rebuild an innocent episode on the fresh ``worker`` (its gate held): create it again and step its accepted
        messages; an episode is a deterministic function of them, and each reply must match the one its client got.
        An episode that diverges or cannot finish within the replay budget stays lost (``WorkerLost`` on its next
        request, with the reason)."""
        try:
            self._exchange(worker, deadline, "create", handle._key, *handle._create_args)
            for content, reply in handle._history:
                if _reply_fingerprint(self._exchange(worker, deadline, "step", handle._key, content)) != reply:
                    raise _ReplayFailed("its replay answered differently from the original")
        except _ReplayFailed as failure:
            handle.lost_reason = f"its worker was replaced and {failure}"
            with contextlib.suppress(_ReplayFailed):
                self._exchange(worker, deadline + SHORT_REQUEST_S, "close", handle._key)
            log.warning("episode %s not rebuilt: %s", handle._key, handle.lost_reason)
            return
        with self._state:
            worker.episodes[handle._key] = handle
        handle._generation = worker.generation
        log.info("episode %s rebuilt on the replacement worker (%d messages)", handle._key, len(handle._history))

    def _exchange(self, worker: _Worker, deadline: float, op: str, key: str, *args):
        """One request to ``worker`` during a replay (its gate held), answered before ``deadline``."""
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise _ReplayFailed(f"its replay ran past the budget of {self.limits.replay_budget_s:g} s")
            worker.conn.send((op, key, args))
            if not worker.conn.poll(remaining):
                raise _ReplayFailed(f"its replay ran past the budget of {self.limits.replay_budget_s:g} s")
            ok, payload = worker.conn.recv()
        except (EOFError, OSError) as error:
            raise _ReplayFailed(f"its replay lost the new worker ({type(error).__name__})") from None
        if not ok:
            raise _ReplayFailed(f"its replay failed ({payload[0]})")
        return payload

    # -- requests ------------------------------------------------------------------------------

    def _request(self, worker: _Worker, generation, owner, budget_s: float, op: str, key: str, *args):
        """``generation``: the worker generation the episode lives in, or its handle (read once the gate is held:
        a replay while this request waited moves the episode to the new generation). ``owner``: whose request it is;
        the worker's time it takes (a replay after a kill included) is charged to that owner's usage."""
        if not worker.gate.acquire(owner, timeout=QUEUE_TIMEOUT_S):
            raise WorkerBusy(f"the episode's worker stayed busy for {QUEUE_TIMEOUT_S:.0f} s")
        try:
            handle = generation if isinstance(generation, RemoteEpisode) else None
            if handle is not None:
                generation = handle._generation
            if worker.generation != generation:
                reason = (handle.lost_reason if handle is not None else None) or "the worker holding it was replaced"
                raise _ReplacedBeforeSent(reason)
            deadline_s = budget_s + self.limits.worker_grace_s
            worker.busy_since, worker.busy_deadline_s = time.monotonic(), deadline_s
            try:
                worker.conn.send((op, key, args))
                if not worker.conn.poll(deadline_s):
                    self._kill(worker, f"no answer to {op} within {deadline_s:g} s", offender=key)
                    raise WorkerLost(
                        f"the episode's worker did not answer {op} within {deadline_s:g} s and was replaced"
                    )
                ok, payload = worker.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as error:
                self._kill(worker, f"connection lost during {op} ({type(error).__name__})", offender=key)
                raise WorkerLost(f"the episode's worker died during {op} and was replaced") from None
            finally:
                now = time.monotonic()
                self.usage.charge(owner, now - worker.busy_since)
                with self._state:  # _placement iterates the deque
                    worker.recent.append((now, now - worker.busy_since))
                    worker.busy_since = None
        finally:
            worker.gate.release()
        if ok:
            return payload
        kind, message = payload
        if kind == "ValueError":
            raise ValueError(message)
        raise RemoteError(kind, message)

    def create(
        self, key: str, task_id: str, mode: str, config, profile, memory_snapshot=None, owner=None
    ) -> RemoteEpisode:
        self.start()
        for attempt in range(2):  # one queued behind a request that got its worker killed goes to the replacement
            with self._state:
                worker = self._placement()
                worker.episodes[key] = None
                generation = worker.generation
            try:
                args = (task_id, mode, config, profile, memory_snapshot)
                messages, info = self._request(worker, generation, owner, SHORT_REQUEST_S, "create", key, *args)
                break
            except _ReplacedBeforeSent:
                with self._state:
                    worker.episodes.pop(key, None)
                if attempt:
                    raise
            except BaseException:
                with self._state:
                    worker.episodes.pop(key, None)
                raise
        handle = RemoteEpisode(self, worker, generation, key, messages, info, owner)
        handle._create_args = args
        with self._state:
            if key in worker.episodes:  # not lost while it was being created
                worker.episodes[key] = handle
        return handle

    def replace_dead(self) -> int:
        """Replace workers that died between requests (their episodes are lost); returns how many."""
        replaced = 0
        for worker in self._workers:
            if worker.process is None or worker.process.poll() is None:
                continue
            if worker.gate.try_acquire():  # a busy one is handled by its request
                try:
                    if worker.process.poll() is not None:
                        self._kill(worker, f"exited with code {worker.process.returncode}")
                        replaced += 1
                finally:
                    worker.gate.release()
        return replaced

    def _busy_share(self, worker: _Worker, now: float) -> float:
        """Share of the last ``BUSY_WINDOW_S`` the worker spent on requests (call with ``_state`` held)."""
        while worker.recent and worker.recent[0][0] < now - BUSY_WINDOW_S:
            worker.recent.popleft()
        busy = sum(seconds for _, seconds in worker.recent)
        since = worker.busy_since
        if since is not None:
            busy += now - since
        return busy / BUSY_WINDOW_S

    def _placement(self) -> _Worker:
        now = time.monotonic()
        calm = [w for w in self._workers if self._busy_share(w, now) < 0.5] or self._workers
        return min(calm, key=lambda w: len(w.episodes))

    def forget(self, worker: _Worker, key: str) -> None:
        with self._state:
            worker.episodes.pop(key, None)

    # -- health / shutdown ---------------------------------------------------------------------

    def health(self) -> dict:
        """Per worker: alive, busy for how long, whether it answers (alive, and not past its deadline)."""
        now = time.monotonic()
        rows = []
        for w in self._workers:
            alive = w.process is not None and w.process.poll() is None
            busy_since = w.busy_since
            busy_s = 0.0 if busy_since is None else now - busy_since
            rows.append(
                {
                    "pid": w.process.pid if w.process else None,
                    "alive": alive,
                    "busy_s": round(busy_s, 3),
                    "answering": alive
                    and busy_s <= w.busy_deadline_s + 1.0
                    and now - w.last_beat <= HEARTBEAT_TIMEOUT_S,
                    "heartbeat_age_s": round(now - w.last_beat, 3),
                    "episodes": len(w.episodes),
                    "restarts": w.restarts,
                }
            )
        answering = sum(r["answering"] for r in rows)
        spare = self._spare
        return {
            "workers": len(rows),
            "workers_answering": answering,
            "ok": answering == len(rows),
            "worker_restarts": sum(r["restarts"] for r in rows),
            "per_worker": rows,
            "spare_pid": spare.process.pid if spare is not None else None,  # the next replacement, holding nothing
        }

    def close(self) -> None:
        with self._state:
            started, self._started = self._started, False
        if not started:
            return
        with self._spare_lock:  # _launch_spare starts none from now on
            spare, self._spare = self._spare, None
        if spare is not None:
            self._retire(spare)  # killed: it may still be importing, and holds nothing
        for worker in self._workers:
            if worker.conn is not None:
                worker.conn.close()
            if worker.process is not None:
                try:
                    worker.process.wait(2)  # it exits when its end of the socket closes
                except subprocess.TimeoutExpired:
                    worker.process.kill()
                    worker.process.wait()
            worker.episodes.clear()
        self._monitor.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)


class _HeartbeatMonitor:
    """One daemon thread that reads every worker's heartbeats and records the latest (``_Worker.last_beat``)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}  # heartbeat socket fd -> worker
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None

    def watch(self, worker: _Worker) -> None:
        with self._lock:
            self._workers[worker.beats.fileno()] = worker
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="env-heartbeats", daemon=True)
                self._thread.start()
        self._wake_w.send(b".")

    def forget(self, beats: socket.socket) -> None:
        with self._lock:
            self._workers.pop(beats.fileno(), None)

    def stop(self) -> None:
        with self._lock:
            self._workers.clear()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = dict(self._workers)
            try:
                readable, _, _ = select.select([self._wake_r, *(w.beats for w in watched.values())], [], [], 1.0)
            except (OSError, ValueError):  # a replaced worker's socket closed under us: look again
                continue
            for sock in readable:
                if sock is self._wake_r:
                    if b"!" in sock.recv(64):
                        return
                    continue
                self._drain(sock, watched.get(sock.fileno()))

    @staticmethod
    def _drain(sock: socket.socket, worker: _Worker | None) -> None:
        try:
            while True:
                beat = sock.recv(_BEAT.size, socket.MSG_DONTWAIT)
                if not beat:
                    return
                if worker is not None and len(beat) == _BEAT.size:
                    worker.last_beat = max(worker.last_beat, _BEAT.unpack(beat)[0])
        except (BlockingIOError, OSError):
            return


class _ReplayFailed(Exception):
    """Why an innocent episode could not be rebuilt on a replacement worker."""


def _reply_fingerprint(result) -> str:
    """What the client saw of a step (the reply texts and whether it ended), to check a replay against."""
    seen = [result.message, result.extra_messages, result.terminated]
    return hashlib.sha256(json.dumps(seen, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


class RemoteEpisode:
    """The manager's handle on an episode that lives in a worker (the same methods as ``Episode``).

    It keeps what a replay needs (the create arguments, each accepted message with a fingerprint of its reply)
    while that stays within ``max_episode_bytes``; beyond, the episode is not rebuilt if its worker is lost. Each
    reply's ``info["kept_bytes"]`` (what the episode keeps in its worker) gets the messages counted here added, so
    that it says what the episode costs both processes.
    """

    def __init__(self, pool: WorkerPool, worker: _Worker, generation: int, key: str, messages, info, owner=None):
        self._pool, self._worker, self._generation, self._key = pool, worker, generation, key
        self._owner = owner  # whose usage its requests are charged to
        self._messages = messages
        self.info = info
        self.terminated = False
        self._create_args: tuple = ()
        self._history: list[tuple[str, str]] = []  # (message, fingerprint of its reply)
        self._history_bytes = 0
        self.replayable = True
        self.lost_reason: str | None = None

    def initial_messages(self) -> list[dict]:
        return self._messages

    def step(self, assistant_text: str):
        budget = self._pool.limits.message_budget_s
        result = self._pool._request(self._worker, self, self._owner, budget, "step", self._key, assistant_text)
        self.terminated = result.terminated
        self._remember(assistant_text, result)
        result.info["kept_bytes"] += self._history_bytes
        return result

    def _remember(self, content: str, result) -> None:
        self._history_bytes += len(content) + 64
        if self._history_bytes > self._pool.limits.max_episode_bytes:
            self.replayable, self._history = False, []
        elif self.replayable:
            self._history.append((content, _reply_fingerprint(result)))

    def evaluate(self, reward_cfg=None) -> dict:
        budget = self._pool.limits.evaluate_budget_s
        return self._pool._request(self._worker, self, self._owner, budget, "evaluate", self._key, reward_cfg)

    def close(self) -> None:
        self._pool.forget(self._worker, self._key)
        try:
            self._pool._request(self._worker, self, self._owner, SHORT_REQUEST_S, "close", self._key)
        except (WorkerLost, WorkerBusy):
            pass  # nothing left to free
        finally:  # a replacement's replay, which this request waited for, listed it again: else the next kill revives it
            self._pool.forget(self._worker, self._key)


__all__ = ["RemoteEpisode", "RemoteError", "WorkerBusy", "WorkerLost", "WorkerPool"]


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])))
