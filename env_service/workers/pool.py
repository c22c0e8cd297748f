"""Episodes in worker processes: every core busy, time budgets that can interrupt, and hangs contained.

Backend work is CPU-bound Python, so one process runs one call at a time whatever the threads. The
:class:`WorkerPool` starts ``n`` processes (``python -m env_service.workers.pool FD``, talking pickles over a
socket pair: nothing of the service's threaded process is forked, and no caller's main module is re-run,
as multiprocessing's spawn would); each loads the task table once (about 2 s) and
then holds whole :class:`~env_service.bfcl.episode.Episode` objects — backends, turn records, the verifier's replay
at evaluate — keyed by the manager's instance id. An episode stays on the worker that created it, because
its backend state lives there. A new episode goes to the worker with the fewest episodes among those busy
less than half of the last ``BUSY_WINDOW_S`` (all of them when none is): a worker that a hostile client keeps
busy with budget-exhausting messages gets no new episodes while another one has room.

Inside a worker, calls run on the main thread, where the episode's time budgets interrupt them
(:func:`~env_service.bfcl.executor.time_limit`). The parent waits for each answer at most the request's budget
plus ``worker_grace_s``; a worker that does not answer by then (work a timer cannot interrupt, the memory cap) is
killed and replaced, and the episode whose request it was serving is the one that fails, with :class:`WorkerLost`.
A worker that dies of another cause (the OOM killer, an operator) is noticed the moment it exits (the monitor
thread watches each process's pidfd) and replaced at once, blaming no one; one that dies under a request is
replaced and the request tried once more on the replacement: only an episode whose own request its worker dies
under twice is lost. Every other episode the dead worker held is rebuilt on the replacement, before its next
request is served, by replaying its accepted messages (each reply checked against the one the client got). A
replay is its own episode's work: it is charged to its owner, takes turns with other owners' requests like the
messages it replays did, and has a budget of its own (twice the worker time its create and messages took, plus
``replay_budget_s``), so one owner's slow episodes never use up another's. Workers run with one pinned hash seed
(:data:`WORKER_HASH_SEED`): a backend that iterates a set of strings answers alike on every worker, so a replay on
the replacement answers as the original did. Requests to one worker are serialised in the parent by a
:class:`~env_service.workers.fair_gate.FairGate`, so the pipe carries one request at a time, and a waiting request of the
owner that used the workers least lately goes first: an owner that keeps many budget-busting messages queued delays
its own requests, not another owner's.

A request cannot overtake the message running on its worker, and a message may run for its whole budget (seconds).
So a request that has waited ``move_after_s`` behind one (and at least as long as its own episode's replay would take)
moves its episode to a calm worker, idle and with no queue, and is served there: the episode is rebuilt by the same
replay as after a kill (charged to its owner), and the copy left behind is closed before that worker serves anything
else. An innocent step beside an episode of 4-s messages waited for the message running when it came (the red team's
p99: 9 ms alone, 3.4 s beside it); now it waits ``move_after_s`` and its replay. The long message runs on untouched,
and an episode whose replay would cost more than the wait it escapes stays (a heavy episode never moves onto a calm
worker). When no worker is calm, the request waits its turn as before.

The replacement is a spare: one more process, started (and its imports and task table loaded) long before it is
needed, that holds no episode until a kill hands it the dead worker's place; the next spare starts right after. Without it
the innocent episodes waited for a cold start (seconds on a loaded machine) before their replay.
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
import selectors
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

from env_service import abandon as abandoned
from env_service.bfcl import tasks
from env_service.bfcl.config import ServiceLimits
from env_service.bfcl.ood_episode import load_any_task, new_episode
from env_service.bfcl.scratch import SCRATCH_ENV, make_scratch_root
from env_service.sizes import measured_bytes
from env_service.workers.fair_gate import FairGate, Usage
from env_service.workers.parent_watch import exit_with_parent

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
#: The monitor looks at every process at least this often, pidfd or not (where a pidfd is missing, this is how long
#: a death between requests may go unnoticed).
MONITOR_WAKE_S = 1.0
#: The monitor waits out an error of its own loop, doubling up to this (never a busy loop).
MONITOR_BACKOFF_MAX_S = 5.0
#: The hash seed of every worker process: set iteration (bfcl backends iterate sets of strings) is the same in each,
#: so an episode replays identically on any worker and a run's environment replies are reproducible. Which value does
#: not matter; that it is one value does.
WORKER_HASH_SEED = "0"
#: An episode's replay on a replacement worker may take this many times the worker time its create and accepted
#: messages took, plus ``replay_budget_s``.
REPLAY_COST_FACTOR = 2.0
_BEAT = struct.Struct("d")  # one beat: the worker's time.monotonic() (system-wide on Linux)


class WorkerLost(Exception):
    """The worker that held an episode died or was killed; the episode is gone."""


class _ReplacedBeforeSent(WorkerLost):
    """The worker was replaced while a request waited for it; the request was never sent."""


class _DiedUnderRequest(Exception):
    """The worker died under a request (not at its deadline) and was replaced; the request may be tried again."""


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
    moved_away: list = field(default_factory=list)  # (key, owner) of copies of episodes moved off it, to be closed


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
        self._monitor = _Monitor(self._on_exit)
        self.scratch = make_scratch_root()
        self._launches = itertools.count()  # names each process's scratch folder
        self._spare: _Worker | None = None  # launched, ready or nearly, holding no episode (see the module docstring)
        self._spare_lock = threading.Lock()  # guards _spare (two workers may be killed at once)
        self.moves = 0  # episodes moved off a worker busy with a long request (see the module docstring)

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
        self._monitor.forget(spare)
        worker.process, worker.conn, worker.beats = spare.process, spare.conn, spare.beats
        worker.scratch, worker.last_beat = spare.scratch, time.monotonic()
        self._monitor.watch(worker)
        return True

    def _launch(self, worker: _Worker) -> None:
        ours, theirs = socket.socketpair()
        beats_ours, beats_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        package_root = str(Path(__file__).resolve().parents[2])
        scratch = os.path.join(self.scratch, f"worker-{next(self._launches)}")
        os.makedirs(scratch)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
            SCRATCH_ENV: scratch,
            "PYTHONHASHSEED": WORKER_HASH_SEED,  # read when the interpreter starts: it must be in the child's environment
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "env_service.workers.pool", str(theirs.fileno()), str(beats_theirs.fileno())],
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
        self._monitor.forget(worker)  # first: this exit is ours, not one to replace
        if worker.beats is not None:
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
        """Kill and replace ``worker`` (its gate held). The episode ``offender`` (the one whose request it died on,
        if it is to blame) is lost; every other one it held is marked to be rebuilt on the replacement before its
        next request (``_rebuild``), but one whose messages were not kept (over ``max_episode_bytes``)."""
        log.error(
            "env worker %d (pid %s): %s; replacing it (%d episodes on it)",
            worker.index,
            worker.process.pid,
            why,
            len(worker.episodes),
        )
        self._retire(worker)
        worker.generation += 1
        with self._state:
            worker.moved_away.clear()  # those copies went with the process
            for key, handle in list(worker.episodes.items()):
                if handle is not None and key != offender and handle.replayable:
                    handle._mark_for_rebuild(worker.generation, "its worker was replaced")
                    continue
                del worker.episodes[key]  # a create in flight is retried by its caller
                if handle is not None and key != offender:
                    handle.lost_reason = "its worker was replaced and its messages were over max_episode_bytes"
        if not self._take_spare(worker):
            self._spawn(worker)
        worker.restarts += 1  # once the replacement is in place
        self._launch_spare()

    def _replace_if_exited(self, worker: _Worker) -> None:
        """Replace ``worker`` (its gate held) if its process exited since its last request: no one is to blame."""
        if worker.process is not None and worker.process.poll() is not None:
            self._kill(worker, f"exited with code {worker.process.returncode} between requests")

    def _on_exit(self, worker: _Worker) -> None:
        """The monitor saw ``worker``'s process exit: replace it now (in a thread: the gate may be held a while),
        rather than when a request next finds it dead."""
        if worker.gate is None:  # the spare, which holds nothing: a kill that finds it dead starts one cold
            log.warning("the spare env worker (pid %s) exited; the next replacement starts cold", worker.process.pid)
            return
        threading.Thread(target=self._replace_exited, args=(worker,), name="env-worker-replace", daemon=True).start()

    def _replace_exited(self, worker: _Worker) -> None:
        if not worker.gate.acquire(None, timeout=QUEUE_TIMEOUT_S):
            return  # busy all along: the request that holds it finds the worker dead and replaces it
        try:
            if self._started:
                self._replace_if_exited(worker)
        except Exception:  # noqa: BLE001 - a daemon thread: the next request tries again
            log.exception("replacing env worker %d failed", worker.index)
        finally:
            worker.gate.release()

    def _rebuild(self, worker: _Worker, handle: RemoteEpisode, held_since: float, blame: bool) -> bool:
        """Replay ``handle``'s episode onto ``worker`` (its gate held, since ``held_since``) from where its replay
        stands: its create, then its accepted messages, each reply checked against the one its client got (an episode
        is a deterministic function of them). False when the next message would take this hold past a message budget's
        worth (as it took the original): the worker is yielded to other requests before the rest, as it was between the
        replayed messages. An episode that diverges or runs past its own replay budget is lost (``WorkerLost``)."""
        replayed = False
        while handle._replay_next is not None:
            held = time.monotonic() - held_since
            if replayed and held + handle._recorded_s(handle._replay_next) > self.limits.message_budget_s:
                return False
            self._replay_one(worker, handle, blame)
            replayed = True
        return True

    def _replay_one(self, worker: _Worker, handle: RemoteEpisode, blame: bool) -> None:
        position = handle._replay_next
        budget = handle.replay_budget_s()
        if handle._replay_spent > budget:
            self._lose(worker, handle, f"its replay ran past its budget of {budget:.3g} s")
        if position == 0:
            op, budget_s, args = "create", SHORT_REQUEST_S, handle._create_args
        else:
            op, budget_s, args = "step", self.limits.message_budget_s, (handle._history[position - 1][0],)
        ok, payload, seconds = self._exchange(worker, handle._owner, budget_s, op, handle._key, args, blame)
        handle._replay_spent += seconds
        if not ok:
            self._lose(worker, handle, f"its replay failed ({payload[0]})")
        if position and _reply_fingerprint(payload) != handle._history[position - 1][1]:
            self._lose(worker, handle, "its replay answered differently from the original")
        handle._replay_next = position + 1 if position < len(handle._history) else None
        if handle._replay_next is None:
            log.info("episode %s rebuilt on a replacement worker (%d messages)", handle._key, len(handle._history))

    def _lose(self, worker: _Worker, handle: RemoteEpisode, problem: str) -> None:
        """Give up rebuilding ``handle``'s episode (its gate held): free what its replay made, and raise."""
        handle.lost_reason = f"{handle._rebuilt_because} and {problem}"
        created, handle._replay_next, handle._generation = handle._replay_next != 0, None, -1
        self.forget(worker, handle._key)
        if created:
            with contextlib.suppress(WorkerLost, _DiedUnderRequest):
                self._exchange(worker, handle._owner, SHORT_REQUEST_S, "close", handle._key, (), True)
        log.warning("episode %s not rebuilt: %s", handle._key, handle.lost_reason)
        raise WorkerLost(handle.lost_reason)

    # -- requests ------------------------------------------------------------------------------

    def _exchange(self, worker: _Worker, owner, budget_s: float, op: str, key: str, args: tuple, blame: bool):
        """Send one request to ``worker`` (its gate held) and wait for its answer, at most ``budget_s`` plus the
        grace: ``(ok, payload, worker seconds)``, the seconds charged to ``owner``. A worker past that deadline is
        killed and the request's episode lost (``WorkerLost``). One that dies under the request is replaced too, and
        the episode lost only when ``blame`` (it died under this request once already); else ``_DiedUnderRequest``,
        and the caller tries again on the replacement."""
        deadline_s = budget_s + self.limits.worker_grace_s
        worker.busy_since, worker.busy_deadline_s = time.monotonic(), deadline_s
        died: str | None = None  # why the connection failed, if it did
        try:
            worker.conn.send((op, key, args))
            answered = worker.conn.poll(deadline_s)
            if answered:
                ok, payload = worker.conn.recv()
        except (EOFError, OSError) as error:
            died = type(error).__name__
        finally:  # measured before any replacement, which is no one's request
            now = time.monotonic()
            seconds = now - worker.busy_since
            self.usage.charge(owner, seconds)
            with self._state:  # _placement iterates the deque
                worker.recent.append((now, seconds))
                worker.busy_since = None
        if died is not None:
            why = f"connection lost during {op} ({died})"
            if blame:
                self._kill(worker, f"{why}, the second time for this request", offender=key)
                raise WorkerLost(f"the episode's worker died during {op}, twice, and was replaced")
            self._kill(worker, f"{why}; the request is tried again on the replacement")
            raise _DiedUnderRequest
        if not answered:
            self._kill(worker, f"no answer to {op} within {deadline_s:g} s", offender=key)
            raise WorkerLost(f"the episode's worker did not answer {op} within {deadline_s:g} s and was replaced")
        return ok, payload, seconds

    def _request(self, worker: _Worker, target, owner, budget_s: float, op: str, key: str, *args):
        """One request for the episode ``key``: ``(its answer, the worker seconds it took)``, charged to ``owner``.

        ``target``: the worker generation the episode lives in (a create), or its handle (read once the gate is held:
        a kill while this request waited marks the episode for rebuild, and the rebuild comes first). A worker found
        dead is replaced before anything is sent; a worker that dies under the request is replaced and the request
        tried once more (see ``_exchange``)."""
        handle = target if isinstance(target, RemoteEpisode) else None
        retried = False
        # A request whose client is gone stops waiting for the worker, and is not sent once it gets it; a close
        # always goes on (the manager has let go of the episode already: only the close frees it here).
        abandon = abandoned.current() if op != "close" else None
        movable = handle if op != "close" else None
        while True:
            worker = self._hold(worker, movable, owner, abandon)
            try:
                if abandon is not None:
                    abandoned.check()
                held_since = time.monotonic()
                self._replace_if_exited(worker)
                self._close_moved_away(worker)
                if worker.generation != (handle._generation if handle is not None else target):
                    reason = (
                        handle.lost_reason if handle is not None else None
                    ) or "the worker holding it was replaced"
                    raise _ReplacedBeforeSent(reason)
                if handle is not None and handle._replay_next is not None:
                    if op == "close" and handle._replay_next == 0:
                        return None, 0.0  # not rebuilt yet: nothing of it on the worker
                    if op != "close" and not self._rebuild(worker, handle, held_since, retried):
                        continue  # the rest of a long replay waits its turn at the gate
                ok, payload, seconds = self._exchange(worker, owner, budget_s, op, key, args, retried)
                break
            except _DiedUnderRequest:
                retried = True
            finally:
                worker.gate.release()
        if ok:
            return payload, seconds
        kind, message = payload
        if kind == "ValueError":
            raise ValueError(message)
        raise RemoteError(kind, message)

    def _hold(self, worker: _Worker, handle: RemoteEpisode | None, owner, abandon) -> _Worker:
        """Take the gate of the worker the request is to be served on: ``worker``, or the calm one that ``handle``'s
        episode moved to while it waited behind a long request (see the module docstring)."""
        give_up = time.monotonic() + QUEUE_TIMEOUT_S
        while True:
            now = time.monotonic()
            wait = give_up - now
            if handle is not None and handle.replayable and self.limits.move_after_s > 0:
                patience = self._patience(worker, handle, now)
                if patience <= 0 and (calm := self._move(handle, worker)) is not None:
                    worker = calm
                    continue
                wait = min(wait, patience if patience > 0 else self.limits.move_after_s)  # none calm: look again
            if worker.gate.acquire(owner, timeout=max(wait, 0.0), abandon=abandon):
                return worker
            abandoned.check()
            if time.monotonic() >= give_up:
                raise WorkerBusy(f"the episode's worker stayed busy for {QUEUE_TIMEOUT_S:.0f} s")

    def _patience(self, worker: _Worker, handle: RemoteEpisode, now: float) -> float:
        """Seconds until the request running on ``worker`` will have run long enough for ``handle``'s episode to move:
        ``move_after_s``, and at least what its replay took the first time (a move must cost less than the wait)."""
        enough = max(self.limits.move_after_s, handle._cost_s)
        since = worker.busy_since
        return enough if since is None else since + enough - now  # None: between two requests; look again later

    def _move(self, handle: RemoteEpisode, worker: _Worker) -> _Worker | None:
        """Move ``handle``'s episode from ``worker`` to a calm worker (idle, no request waiting, busy less than half
        of its last ``BUSY_WINDOW_S``; the one with the fewest episodes), to be rebuilt there before its request is
        served; None when no worker is calm, or the episode is no longer on ``worker`` (lost, or closing)."""
        now = time.monotonic()
        with self._state:
            calm = [
                w
                for w in self._workers
                if w is not worker and w.busy_since is None and not w.gate.waiting() and self._busy_share(w, now) < 0.5
            ]
            if not calm or worker.episodes.get(handle._key) is not handle:
                return None
            target = min(calm, key=lambda w: len(w.episodes))
            del worker.episodes[handle._key]
            target.episodes[handle._key] = handle
            if handle._replay_next != 0:  # some of it is on the worker it leaves: closed there before its next request
                worker.moved_away.append((handle._key, handle._owner))
            handle._worker = target
            handle._mark_for_rebuild(target.generation, "it was moved off a worker busy with a long request")
            self.moves += 1
        log.debug("episode %s moved from env worker %d to %d", handle._key, worker.index, target.index)
        return target

    def _close_moved_away(self, worker: _Worker) -> None:
        """Close the copies of the episodes moved off ``worker`` (its gate held) before it serves anything else: they
        hold its memory, and an episode that moves back is rebuilt here under the same key."""
        with self._state:
            moved, worker.moved_away = worker.moved_away, []
        for key, owner in moved:
            try:
                self._exchange(worker, owner, SHORT_REQUEST_S, "close", key, (), False)
            except (WorkerLost, _DiedUnderRequest):  # the worker was replaced: the copies went with its process
                return

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
                (messages, info), seconds = self._request(
                    worker, generation, owner, SHORT_REQUEST_S, "create", key, *args
                )
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
        handle._create_args, handle._create_s, handle._cost_s = args, seconds, seconds
        handle._own_bytes = measured_bytes([messages, info, args])  # what it holds here from its creation
        with self._state:
            if key in worker.episodes:  # not lost while it was being created
                worker.episodes[key] = handle
        return handle

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
            "episodes_moved": self.moves,  # off a worker busy with a long request, to a calm one
            "per_worker": rows,
            "spare_pid": spare.process.pid if spare is not None else None,  # the next replacement, holding nothing
        }

    def close(self) -> None:
        with self._state:
            started, self._started = self._started, False
        if not started:
            return
        self._monitor.stop()  # first: the workers exit below, and none is to be replaced
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
        shutil.rmtree(self.scratch, ignore_errors=True)


class _Monitor:
    """One daemon thread that watches every worker process: it records each one's heartbeats (``_Worker.last_beat``)
    and calls ``on_exit(worker)`` the moment one exits (its pidfd turns readable; every ``MONITOR_WAKE_S`` anyway).

    ``selectors`` (epoll on Linux), not ``select.select``, which refuses descriptors from 1024 up, numbers a service
    holding many connections reaches. An error in the loop is logged and waited out, never retried at once.
    """

    def __init__(self, on_exit):
        self._on_exit = on_exit
        self._lock = threading.Lock()  # guards _watched and the selector's registrations
        self._selector = selectors.DefaultSelector()
        self._watched: dict[int, list] = {}  # id(worker) -> [worker, process, beats socket, pidfd or None]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stopped = False
        self._thread: threading.Thread | None = None

    def watch(self, worker: _Worker) -> None:
        pidfd = _open_pidfd(worker.process.pid)
        with self._lock:
            if self._stopped:
                if pidfd is not None:
                    os.close(pidfd)
                return
            self._watched[id(worker)] = [worker, worker.process, worker.beats, pidfd]
            self._selector.register(worker.beats, selectors.EVENT_READ, worker)
            if pidfd is not None:
                self._selector.register(pidfd, selectors.EVENT_READ, worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="env-heartbeats", daemon=True)
                self._thread.start()

    def forget(self, worker: _Worker) -> None:
        """Stop watching ``worker``'s process (before the pool kills it, or hands it to another ``_Worker``)."""
        with self._lock:
            entry = self._watched.pop(id(worker), None)
            if entry is not None:
                self._let_go(entry)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for entry in self._watched.values():
                self._let_go(entry)
            self._watched.clear()
            if self._thread is None:  # never started: nothing will close them
                self._close()
                return
        with contextlib.suppress(OSError):  # closed already: the thread saw the flag on a wake of its own
            self._wake_w.send(b"!")

    def _close(self) -> None:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _let_go(self, entry: list) -> None:
        """Unregister an entry's heartbeat socket and pidfd (call with ``_lock`` held)."""
        self._unregister(entry[2])
        self._close_pidfd(entry)

    def _unregister(self, fileobj) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fileobj)

    def _close_pidfd(self, entry: list) -> None:
        if entry[3] is not None:
            self._unregister(entry[3])
            os.close(entry[3])
            entry[3] = None

    def _run(self) -> None:
        failures = 0
        while True:
            try:
                if self._look():
                    return
                failures = 0
            except Exception:  # noqa: BLE001 - the monitor must outlive any error, and must not spin on one
                failures += 1
                log.exception("the env worker monitor failed (%d in a row); waiting before it looks again", failures)
                time.sleep(min(MONITOR_BACKOFF_MAX_S, 0.05 * 2**failures))

    def _look(self) -> bool:
        """One wait for heartbeats and exits; True once stopped."""
        for key, _ in self._selector.select(MONITOR_WAKE_S):
            if key.fileobj is self._wake_r:
                self._wake_r.recv(64)
            elif isinstance(key.fileobj, int):  # a pidfd: its process exited (it stays readable: let go of it)
                with self._lock:
                    entry = self._watched.get(id(key.data))
                    if entry is not None and entry[3] == key.fileobj:
                        self._close_pidfd(entry)
            else:
                self._drain(key.fileobj, key.data)
        with self._lock:
            if self._stopped:
                self._close()
                return True
            exited = [entry for entry in self._watched.values() if entry[1].poll() is not None]
            for entry in exited:
                del self._watched[id(entry[0])]
                self._let_go(entry)
        for entry in exited:
            self._on_exit(entry[0])
        return False

    @staticmethod
    def _drain(sock: socket.socket, worker: _Worker) -> None:
        try:
            while True:
                beat = sock.recv(_BEAT.size, socket.MSG_DONTWAIT)
                if not beat:
                    return
                if len(beat) == _BEAT.size:
                    worker.last_beat = max(worker.last_beat, _BEAT.unpack(beat)[0])
        except OSError:  # drained (BlockingIOError), or closed under us by a replacement
            return


def _open_pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when process ``pid`` exits (Linux 5.3+), or None (then the monitor's look
    every ``MONITOR_WAKE_S`` notices the exit)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _reply_fingerprint(result) -> str:
    """What the client saw of a step (the reply texts and whether it ended), to check a replay against."""
    seen = [result.message, result.extra_messages, result.terminated]
    return hashlib.sha256(json.dumps(seen, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


class RemoteEpisode:
    """The manager's handle on an episode that lives in a worker (the same methods as ``Episode``).

    It keeps what a replay needs (the create arguments, each accepted message with a fingerprint of its reply)
    while that stays within ``max_episode_bytes``; beyond, the episode is not rebuilt if its worker is lost. Each
    reply's ``info["kept_bytes"]`` says what the episode keeps in its worker; the manager adds what is held here
    (:meth:`held_bytes`) and what it holds for the episode, so that their sum says what the episode costs both
    processes. Its replay's budget is its own: ``replay_budget_s()``.
    """

    def __init__(self, pool: WorkerPool, worker: _Worker, generation: int, key: str, messages, info, owner=None):
        self._pool, self._worker, self._generation, self._key = pool, worker, generation, key
        self._owner = owner  # whose usage its requests are charged to
        self._messages = messages
        self.info = info
        self.terminated = False
        self._create_args: tuple = ()
        self._history: list[tuple[str, str, float]] = []  # (message, fingerprint of its reply, worker seconds)
        self._history_bytes = 0
        self._own_bytes = 0
        self.replayable = True
        self.lost_reason: str | None = None
        self._create_s = 0.0  # worker seconds its create took
        self._cost_s = 0.0  # worker seconds its create and accepted messages took
        self._replay_next: int | None = None  # of a pending rebuild: 0 its create, k its k-th message; None: built
        self._rebuilt_because = ""  # why its pending rebuild is (its worker was replaced, or it moved)
        self._replay_spent = 0.0  # worker seconds its pending rebuild has taken so far

    def _mark_for_rebuild(self, generation: int, because: str) -> None:
        """It is to be rebuilt (its worker was replaced, or it moved): it lives in ``generation`` of its worker once
        replayed there (before its next request)."""
        self._generation, self._replay_next, self._replay_spent = generation, 0, 0.0
        self._rebuilt_because = because

    def _recorded_s(self, position: int) -> float:
        """Worker seconds the original of replay exchange ``position`` took (0: the create, k: the k-th message)."""
        return self._history[position - 1][2] if position else self._create_s

    def replay_budget_s(self) -> float:
        """What its replay on a replacement worker may take: a multiple of its own recorded cost, plus slack."""
        return REPLAY_COST_FACTOR * self._cost_s + self._pool.limits.replay_budget_s

    def initial_messages(self) -> list[dict]:
        return self._messages

    def step(self, assistant_text: str):
        budget = self._pool.limits.message_budget_s
        result, seconds = self._pool._request(
            self._worker, self, self._owner, budget, "step", self._key, assistant_text
        )
        self.terminated = result.terminated
        self._remember(assistant_text, result, seconds)
        return result

    def held_bytes(self) -> int:
        """What is held here for the episode, measured (the manager adds it to what it holds for the episode itself):
        its first messages and create arguments (the memory snapshot it may replay, too) and the messages it keeps."""
        return self._own_bytes + self._history_bytes

    def _remember(self, content: str, result, seconds: float) -> None:
        entry = (content, _reply_fingerprint(result), seconds)
        self._history_bytes += measured_bytes(entry)
        if self._history_bytes > self._pool.limits.max_episode_bytes:
            self.replayable, self._history = False, []
        elif self.replayable:
            self._history.append(entry)
            self._cost_s += seconds

    def evaluate(self, reward_cfg=None) -> dict:
        budget = self._pool.limits.evaluate_budget_s
        return self._pool._request(self._worker, self, self._owner, budget, "evaluate", self._key, reward_cfg)[0]

    def close(self) -> None:
        self._pool.forget(self._worker, self._key)  # first: a kill from now on neither rebuilds nor revives it
        with contextlib.suppress(WorkerLost, WorkerBusy):  # nothing left to free
            self._pool._request(self._worker, self, self._owner, SHORT_REQUEST_S, "close", self._key)


__all__ = ["RemoteEpisode", "RemoteError", "WorkerBusy", "WorkerLost", "WorkerPool"]


if __name__ == "__main__":
    _worker_main(Connection(int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])))
