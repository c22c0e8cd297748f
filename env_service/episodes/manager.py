"""Many concurrent episodes behind one object: create / step / evaluate / release / profile / reclaim.

The HTTP service (``service.py``) and the in-process client (``client.py``) are thin layers over
:class:`EpisodeManager`; everything that decides *whether* a request is acceptable lives here, so the
two transports behave identically.

Concurrency model (the released environment keeps one Ray actor per episode; we keep one lock per episode):

* ``_lock`` guards the instance dict and the counters only; it is never held while an episode works,
  so one slow step never blocks the creation or stepping of other episodes.
* each live episode has its own lock, taken without waiting: a request on an episode that is busy with
  another one is refused at once (409 ``episode_busy``; a client retry racing its original request must not
  interleave two steps, and a waiting request would hold one of the service's shared threads);
* with ``workers > 0`` the episodes themselves live in worker processes (``env_service/workers/pool.py``): the slot holds
  a handle, time budgets can interrupt backend calls there, and an episode whose own request got its worker
  killed fails with :class:`EpisodeLost` while every other episode (a finished one, with its verdict, too) is
  rebuilt on the replacement and goes on.

Errors are typed (``errors.py``: :class:`ManagerError` subclasses carrying an HTTP status and a short
code); the service maps them to 4xx bodies ``{"error": code, "detail": message}``. Anything else that escapes an
episode is a bug on our side: it is logged with its traceback and surfaces as :class:`EpisodeFailure`
(500, short message, no traceback).

Instance ids are minted here (unguessable, never reused) and an episode answers only its owner. The limits that
protect other clients (live episodes, what they keep, kept verdicts) count per *client* (the service passes the
client's address): a client naming several run ids (owners) still has one share. Retries are made safe here rather
than in the client: a ``create`` whose ``request_id`` (the caller's key) started a live episode with the same request
and no steps is answered again (the first response was lost), one whose original is still running waits for it and
gets its episode, and ``step`` takes an optional ``seq`` (the 0-based index of the step); a retried step whose ``seq``
was already applied gets the cached response instead of advancing the episode twice.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from env_service.bfcl import ood_tasks
from env_service.bfcl import tasks as tasks_mod
from env_service.bfcl.config import EnvConfig, RewardConfig, ServiceLimits
from env_service.bfcl.ood_episode import check_snapshot, evaluate_only_message, load_any_task, new_episode
from env_service.episodes.kept import KeptBudget, KeptVerdicts
from env_service.errors import (
    BadRequest,
    CapacityExceeded,
    Conflict,
    CreateInProgress,
    EpisodeBusy,
    EpisodeFailure,
    EpisodeLost,
    EvaluateOnly,
    InvalidConfig,
    InvalidContent,
    ManagerError,
    OwnerMemoryExceeded,
    PayloadTooLarge,
    TaskUnavailable,
    UnknownInstance,
    UnknownTask,
)
from env_service.json_safe import json_safe
from env_service.sizes import measured_bytes
from env_service.vocabulary import EPISODE_MODES, MODE_TRAIN
from env_service.workers.pool import WorkerBusy, WorkerLost, WorkerPool

log = logging.getLogger(__name__)

#: Largest assistant message accepted by ``step`` (UTF-8 bytes). Generations are bounded by the
#: trainer's response length (a few thousand tokens), so anything near this is a client bug or abuse.
MAX_CONTENT_BYTES = 256 * 1024
#: Largest failure profile accepted by ``set_profile`` (bytes of its JSON encoding).
MAX_PROFILE_BYTES = 1024 * 1024
#: Longest caller-chosen instance id; ids end up in logs and dict keys.
MAX_INSTANCE_ID_LEN = 200
#: Runs whose failure profiles are kept at once (beyond, the least recently pushed of a run without live
#: episodes is dropped; when every run has live episodes a new run's push is refused).
MAX_RUN_PROFILES = 64
#: How long the evaluation of a released episode is kept for a retried ``evaluate`` (a lost response); how many are
#: kept is ``ServiceLimits.evaluations_kept_per_client`` / ``evaluations_kept``.
EVALUATION_CACHE_TTL_S = 600.0
#: Longest a retried ``create`` waits for its original (the same ``request_id``, still running) before it is answered
#: 503 ``create_in_progress``; the original waits at most for its worker (``workers.QUEUE_TIMEOUT_S``), and a client
#: retries a 503, so a long original costs a few retries, never a second episode.
CREATE_RETRY_WAIT_S = 60.0


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _check_content(content: Any) -> str:
    if not isinstance(content, str):
        raise BadRequest(f"'content' must be a string, got {type(content).__name__}")
    # Cheap upper bound first: a str never encodes to more than 4 bytes per character.
    if len(content) * 4 > MAX_CONTENT_BYTES:
        try:
            size = len(content.encode("utf-8", "surrogatepass"))
        except UnicodeError:
            size = len(content) * 4
        if size > MAX_CONTENT_BYTES:
            raise PayloadTooLarge(
                f"assistant content is {size} bytes; the limit is {MAX_CONTENT_BYTES} bytes "
                f"({MAX_CONTENT_BYTES // 1024} KiB). Truncate the generation before stepping."
            )
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as error:
        # Only a hostile or broken client can produce these (token decoding yields valid text); the
        # tokenizer on the trainer side would choke on them later, so refuse early and say where.
        raise InvalidContent(
            f"content is not valid Unicode: lone surrogate {content[error.start]!r} at index "
            f"{error.start}; send UTF-8 text"
        ) from None
    return content


def check_instance_id(instance_id: Any, what: str = "instance_id") -> str:
    if not isinstance(instance_id, str) or not instance_id:
        raise BadRequest(f"'{what}' must be a non-empty string")
    if len(instance_id) > MAX_INSTANCE_ID_LEN or not instance_id.isprintable():
        raise BadRequest(f"'{what}' must be printable and at most {MAX_INSTANCE_ID_LEN} characters")
    return instance_id


def _config_from_params(params: Any) -> EnvConfig:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise InvalidConfig(f"'params' must be a JSON object, got {type(params).__name__}")
    try:
        return EnvConfig.from_dict(params)
    except (ValueError, TypeError) as error:
        raise InvalidConfig(f"invalid params: {error}") from None


def _reward_config(reward: Any) -> RewardConfig | None:
    """``reward`` (the trainer's ``seal.reward`` block, or null for the episode's own) -> RewardConfig."""
    if reward is None:
        return None
    if not isinstance(reward, dict):
        raise InvalidConfig(f"'reward' must be a JSON object or null, got {type(reward).__name__}")
    try:
        return RewardConfig.from_dict(reward, path="reward")
    except (ValueError, TypeError) as error:
        raise InvalidConfig(f"invalid reward config: {error}") from None


def _request_fingerprint(task_id: str, mode: str, params: dict) -> str:
    return json.dumps([task_id, mode, params], sort_keys=True, default=str)


# ---------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    """One live episode with its bookkeeping."""

    instance_id: str
    episode: Any
    task_id: str
    mode: str
    fingerprint: str
    initial: dict
    created_at: float
    last_access: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    steps: int = 0
    terminated: bool = False
    last_step: dict | None = None  # cached response of step ``steps - 1`` (for retried steps)
    last_content: str | None = None
    closed: bool = False  # released or reclaimed; set under ``lock``
    close_pending: bool = False  # released while a request held ``lock``: that request closes it
    owner: str | None = None  # the run (or client address) that created it; no one else may use it
    client: str | None = None  # the client address whose limits it counts against (whatever run id it names)
    request_key: tuple | None = None  # (owner, request_id) of the create that started it
    run_id: str | None = None  # whose failure profile it got
    kept_bytes: int = 0  # what it keeps, as its last reply said (info["kept_bytes"]); counted in its client's total
    fixed_bytes: int = 0  # what the service holds for it from its creation on (see _slot_bytes)


def _slot_bytes(slot: _Slot) -> int:
    """What the service holds for a live episode, measured: its first answer (a retried create gets it again) and the
    request it was created by (``fixed_bytes``, measured once), its last answer and message (a retried step gets it),
    and what its handle holds here for an episode in a worker (``RemoteEpisode.held_bytes``: its messages, to rebuild
    it). An episode in this process counts itself (``info["kept_bytes"]``)."""
    if not slot.fixed_bytes:
        slot.fixed_bytes = measured_bytes([slot.initial, slot.fingerprint])
    held = getattr(slot.episode, "held_bytes", int)()
    return slot.fixed_bytes + measured_bytes([slot.last_step, slot.last_content]) + held


@dataclass
class _PendingCreate:
    """A create with a ``request_id`` that is still running; a retry with the same key waits for ``done``."""

    fingerprint: str
    done: threading.Event = field(default_factory=threading.Event)


class EpisodeManager:
    """Thread-safe registry of live episodes. See the module docstring for the concurrency model."""

    def __init__(
        self,
        max_episodes: int | None = None,
        idle_timeout_s: float | None = None,
        reclaim_interval_s: float | None = None,
        clock=time.monotonic,
        limits: ServiceLimits | None = None,
        workers: int = 0,
    ):
        """``limits``: budgets and limits (defaults: :class:`ServiceLimits`); the three keyword arguments
        before it override its fields. ``workers``: processes that run the episodes (0: in this process,
        where time budgets hold only on the main thread; see ``env_service/workers/pool.py``)."""
        overrides = {
            "max_episodes": max_episodes,
            "idle_timeout_s": idle_timeout_s,
            "reclaim_interval_s": reclaim_interval_s,
        }
        try:
            limits = (limits or ServiceLimits()).replace(**{k: v for k, v in overrides.items() if v is not None})
        except ValueError as error:
            raise ValueError(f"invalid service limits: {error}") from None
        self.limits = limits
        self.max_episodes = limits.max_episodes
        self.idle_timeout_s = limits.idle_timeout_s
        self.reclaim_interval_s = limits.reclaim_interval_s
        self._pool = None
        if workers:
            self._pool = WorkerPool(workers, limits)
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._requests: dict[tuple, _Slot] = {}  # (owner, request_id) -> the live episode that create started
        self._creating: dict[tuple, _PendingCreate] = {}  # (owner, request_id) -> its create, still running
        # client -> what its live episodes keep together (the sum of their slots' kept_bytes; max_owner_bytes)
        self._client_bytes: dict[str | None, int] = {}
        # run id ("" for requests that name none) -> {"profile", "version", "updated_at"}, oldest push first
        self._profiles: OrderedDict[str, dict] = OrderedDict()
        self._profile_version = 0
        self._verdicts = KeptVerdicts(  # evaluations of released episodes, for retries
            KeptBudget(
                limits.evaluations_kept_per_client,
                limits.evaluations_kept,
                limits.evaluation_bytes_kept_per_client,
                limits.evaluation_bytes_kept,
                EVALUATION_CACHE_TTL_S,
            ),
            clock,
        )
        self._known_tasks: frozenset[str] | None = None
        self._counts = {
            "created": 0,
            "released": 0,
            "reclaimed": 0,
            "steps": 0,
            "evaluations": 0,
            "client_errors": 0,
            "episode_failures": 0,
            "episodes_lost": 0,
            "abandoned": 0,  # episodes created for a client gone before the answer, released at once
        }

    # -- bookkeeping ---------------------------------------------------------------------------

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def warm_up(self) -> None:
        """Load the task table (once per process; ``tasks`` serialises concurrent first loads) so the first
        requests do not pay for it. The service calls this at startup; ``create`` calls it too."""
        if self._known_tasks is None:
            ids = tasks_mod.task_ids("all")
            tasks_mod.load_task(ids[0])  # builds and caches every task
            self._known_tasks = frozenset(ids) | frozenset(ood_tasks.all_ood_task_ids())
        if self._pool is not None:
            self._pool.start()

    def _task_ids(self) -> frozenset[str]:
        self.warm_up()
        return self._known_tasks

    @staticmethod
    def _may_use(slot: _Slot, owner: str | None) -> bool:
        """Only the owner that created an episode may use it (``owner`` None: a trusted in-process caller)."""
        return owner is None or slot.owner == owner

    def _slot(self, instance_id: Any, owner: str | None = None) -> _Slot:
        instance_id = check_instance_id(instance_id)
        with self._lock:
            slot = self._slots.get(instance_id)
        if slot is not None and not self._may_use(slot, owner):
            slot = None  # answered like an unknown id: another run's requests learn nothing of it
        if slot is None:
            raise UnknownInstance(
                f"unknown instance_id {instance_id!r}: never created, already released, or "
                f"reclaimed after {self.idle_timeout_s:.0f} s idle; create a new episode"
            )
        return slot

    def _touch(self, slot: _Slot) -> None:
        """A request on the episode succeeded: it is not idle. (Refused requests never count as use.)"""
        slot.last_access = self._clock()

    def _acquire(self, slot: _Slot) -> None:
        # Never wait: a waiting request would hold one of the service's shared threads, and 80 requests
        # queued on one episode would starve every other episode of them.
        if not slot.lock.acquire(blocking=False):
            raise EpisodeBusy(
                f"episode {slot.instance_id!r} is busy with another request; send one request per episode "
                f"at a time (retry once it has answered)"
            )
        if slot.closed:  # released just before
            self._unlock(slot)
            raise UnknownInstance(f"episode {slot.instance_id!r} was released")

    def _unlock(self, slot: _Slot) -> None:
        """Release the slot's lock; a release that came while the request ran closes the episode now."""
        slot.lock.release()
        if slot.close_pending:
            self._close(slot)

    def _guard(self, what: str, slot: _Slot, fn, *args):
        """Run an episode method; unexpected exceptions become EpisodeFailure (logged, 500)."""
        try:
            return fn(*args)
        except ManagerError:
            raise
        except WorkerLost as error:
            self._drop_lost(slot)
            raise EpisodeLost(f"episode {slot.instance_id!r} is lost: {error}; start a new episode") from None
        except WorkerBusy as error:
            raise CapacityExceeded(f"{error}; retry later") from None
        except Exception as error:  # noqa: BLE001 - a bug in an episode must not take the service down
            self._count("episode_failures")
            log.exception("%s failed for episode %s (task %s)", what, slot.instance_id, slot.task_id)
            raise EpisodeFailure(
                f"internal error during {what} of episode {slot.instance_id!r} "
                f"({type(error).__name__}); the episode may be inconsistent, release it"
            ) from None

    def _drop_lost(self, slot: _Slot) -> None:
        """Forget an episode whose worker was replaced (the caller holds the slot's lock)."""
        with self._lock:
            self._unlist(slot)
            self._counts["episodes_lost"] += 1
        slot.closed = True
        log.warning("episode %s (task %s) lost with its worker", slot.instance_id, slot.task_id)

    # -- create --------------------------------------------------------------------------------

    def create(
        self,
        task_id: Any,
        mode: Any,
        params: Any = None,
        request_id: Any = None,
        owner: str | None = None,
        run_id: str | None = None,
        memory_snapshot: Any = None,
        client: str | None = None,
    ) -> dict:
        """Start an episode; returns ``{"instance_id", "messages", "info"}``.

        The instance id is minted here, unguessable and never reused, so nothing kept for one episode (a cached
        evaluation) can answer for another. ``request_id``: the caller's key for this create, so that a retry
        whose first response was lost gets the same episode back (while it is live and not stepped), and a retry
        that overlaps its original (still running) waits for it and gets its episode.
        ``owner``: who alone may use the episode (the service passes the run id, else the client address).
        ``client``: whose limits it counts against (the service passes the client address, whatever run id the
        request names; default: ``owner``). ``run_id``: whose failure profile a TRAIN episode gets (see
        ``set_profile``). ``memory_snapshot``: the memory an OOD memory episode starts from (what the evaluation of
        the previous prerequisite conversation of its scenario handed back).
        """
        task_id, mode, params = self._check_create(task_id, mode, params)
        config = _config_from_params(params)
        try:
            memory_snapshot = check_snapshot(memory_snapshot)
        except ValueError as error:
            raise (PayloadTooLarge if "limit" in str(error) else BadRequest)(str(error)) from None
        if memory_snapshot is not None and not ood_tasks.is_ood_task(task_id):
            raise BadRequest(f"{task_id} takes no memory_snapshot (only the OOD memory tasks do)")
        fingerprint = _request_fingerprint(task_id, mode, params)
        if memory_snapshot is not None:  # a retried create must carry the same memory
            fingerprint += json.dumps(memory_snapshot, sort_keys=True)
        request_key = None if request_id is None else (owner, check_instance_id(request_id, what="request_id"))
        with self._claimed(request_key, fingerprint) as replay:
            if replay is not None:
                return replay
            client = owner if client is None else client
            instance_id = f"ep_{secrets.token_hex(16)}"
            self._ensure_capacity(client)

            task = self._load_task(task_id)
            episode, messages, profile_version = self._start_episode(
                task, mode, config, run_id, key=instance_id, memory_snapshot=memory_snapshot, owner=owner
            )
            info = {
                "instance_id": instance_id,
                "task_id": task_id,
                "category": task.category,
                "mode": mode,
                "num_turns": task.num_turns,
                "tools_count": len(task.functions),
                "profile_version": profile_version,
                "idle_timeout_s": self.idle_timeout_s,  # how often a client must use or touch it to keep it
            }
            extra = getattr(episode, "info", None)
            if isinstance(extra, dict):
                info = {**extra, **info}
            initial = json_safe({"instance_id": instance_id, "messages": messages, "info": info})
            now = self._clock()
            slot = _Slot(
                instance_id, episode, task_id, mode, fingerprint, initial, now, now, owner=owner, client=client
            )
            initial["info"]["kept_bytes"] += _slot_bytes(slot)  # what the service holds for it: its answer, its key
            slot.request_key, slot.run_id, slot.kept_bytes = request_key, run_id, initial["info"]["kept_bytes"]
            self._register(slot)
            return copy.deepcopy(initial)

    def _register(self, slot: _Slot) -> None:
        """Insert a new slot; the capacity check is repeated under the lock (races). (Its request key needs no check:
        only the create that claimed it gets here.)"""
        with self._lock:
            problem = self._capacity_problem(slot.client)
            if problem is None:
                self._slots[slot.instance_id] = slot
                if slot.request_key is not None:
                    self._requests[slot.request_key] = slot
                self._add_client_bytes(slot.client, slot.kept_bytes)
                self._counts["created"] += 1
        if problem is not None:
            self._close(slot)
            raise problem

    def _start_episode(
        self,
        task,
        mode: str,
        config: EnvConfig,
        run_id: str | None = None,
        key: str = "",
        memory_snapshot=None,
        owner: str | None = None,
    ):
        """Build the episode and its first messages; TRAIN episodes get their run's latest failure profile. The
        episode's worker serves its requests in turn with other owners' (``owner``: whose usage they count)."""
        profile_state = self.get_profile(run_id) if mode == MODE_TRAIN else None
        profile = profile_state["profile"] if profile_state else None
        try:
            if self._pool is not None:
                episode = self._pool.create(key, task.id, mode, config, profile, memory_snapshot, owner)
            else:
                episode = new_episode(task, mode, config, profile, self.limits, memory_snapshot)
            messages = episode.initial_messages()
        except ManagerError:  # its client went while it waited for a worker (ClientGone)
            raise
        except (WorkerLost, WorkerBusy) as error:  # retrying the create is safe
            raise CapacityExceeded(f"cannot start an episode for {task.id} now ({error}); retry") from None
        except ValueError as error:  # a config combination the episode refuses
            raise InvalidConfig(f"cannot start episode for {task.id}: {error}") from None
        except Exception as error:  # noqa: BLE001 - a bug: log it, answer 500 without internals
            self._count("episode_failures")
            log.exception("creating an episode for %s failed", task.id)
            raise EpisodeFailure(f"internal error creating an episode for {task.id} ({type(error).__name__})") from None
        version = profile_state["version"] if profile is not None else None
        return episode, messages, version

    def _check_create(self, task_id: Any, mode: Any, params: Any) -> tuple[str, str, dict]:
        if not isinstance(task_id, str) or not task_id:
            raise BadRequest("'task_id' must be a non-empty string like 'multi_turn_base_0'")
        if mode not in EPISODE_MODES:
            raise BadRequest(f"'mode' must be one of {', '.join(EPISODE_MODES)}; got {mode!r}")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise InvalidConfig(f"'params' must be a JSON object, got {type(params).__name__}")
        if task_id not in self._task_ids():
            shown = task_id if len(task_id) <= 80 else task_id[:80] + "..."
            raise UnknownTask(
                f"unknown task_id {shown!r}; expected 'multi_turn_<category>_<index>' with category "
                f"in {', '.join(tasks_mod.CATEGORIES)} and index 0..{tasks_mod.TASKS_PER_CATEGORY - 1}, "
                f"or an out-of-distribution task of {', '.join(ood_tasks.OOD_CATEGORIES)}"
            )
        category = ood_tasks.ood_category(task_id)
        if category is not None:
            if mode == MODE_TRAIN:
                raise EvaluateOnly(evaluate_only_message(task_id))
            reason = ood_tasks.unavailable_reason(category)
            if reason:
                raise TaskUnavailable(reason)
        return task_id, mode, params

    def _load_task(self, task_id: str):
        """The task: a copy for an episode in this process; with workers (each loads its own), the table's, read only."""
        try:
            return load_any_task(task_id, shared=self._pool is not None)
        except (KeyError, ValueError) as error:
            raise UnknownTask(str(error).strip("'\"")) from None

    @contextlib.contextmanager
    def _claimed(self, request_key: tuple | None, fingerprint: str):
        """Yields None when this create may start the episode of ``request_key`` (None: a create without one), else
        the answer of the create that started it: its first response again (a retry whose answer was lost).

        One create per key runs at a time. A retry that overlaps its original (still running) waits for it
        (``CREATE_RETRY_WAIT_S`` at most, without the lock) and gets the original's episode, instead of starting a
        second one under an id the client would never learn; when the original failed, the retry tries for itself.
        """
        if request_key is None:
            yield None
            return
        deadline = time.monotonic() + CREATE_RETRY_WAIT_S
        while True:
            with self._lock:
                slot = self._requests.get(request_key)
                pending = self._creating.get(request_key) if slot is None else None
                if slot is None and pending is None:
                    pending = self._creating[request_key] = _PendingCreate(fingerprint)
                    break
            if slot is not None:
                yield self._answer_again(slot, request_key, fingerprint)
                return
            if pending.fingerprint != fingerprint:
                raise Conflict(
                    f"request_id {request_key[1]!r} is starting an episode for a different request; choose a new "
                    f"request id"
                )
            if not pending.done.wait(max(0.0, deadline - time.monotonic())):
                raise CreateInProgress(
                    f"the first create with request_id {request_key[1]!r} is still running after "
                    f"{CREATE_RETRY_WAIT_S:.0f} s; retry with the same request_id to get its episode"
                )
        try:
            yield None
        finally:  # registered or failed: the retries waiting on it look again
            with self._lock:
                del self._creating[request_key]
            pending.done.set()

    def _answer_again(self, slot: _Slot, request_key: tuple, fingerprint: str) -> dict:
        """The first response of the live episode ``request_key`` started, for a retry of the same request."""
        if slot.fingerprint == fingerprint and slot.steps == 0:
            slot.last_access = self._clock()
            return copy.deepcopy(slot.initial)
        raise Conflict(
            f"request_id {request_key[1]!r} already started an episode (with a different request, or "
            f"already stepped); choose a new request id or release the old episode"
        )

    def _unlist(self, slot: _Slot) -> None:
        """Take a slot out of the registry (call with ``_lock`` held)."""
        if self._slots.get(slot.instance_id) is slot:
            del self._slots[slot.instance_id]
            self._add_client_bytes(slot.client, -slot.kept_bytes)
        if slot.request_key is not None and self._requests.get(slot.request_key) is slot:
            del self._requests[slot.request_key]

    def _held_by(self, client: str | None) -> int:
        """Live episodes of ``client``, all its run ids together (call with ``_lock`` held)."""
        return sum(1 for slot in self._slots.values() if slot.client == client)

    def _client_full(self, client: str | None) -> CapacityExceeded:
        return CapacityExceeded(
            f"{self.limits.max_episodes_per_owner} live episodes of this client ({client or 'anonymous'}, all its "
            f"run ids) already, its limit (max_episodes_per_owner); release finished episodes or retry later"
        )

    def _add_client_bytes(self, client: str | None, change: int) -> None:
        """Add ``change`` to what ``client``'s live episodes keep (call with ``_lock`` held); a client keeping
        nothing leaves no entry, so clients that come and go do not pile up."""
        total = self._client_bytes.get(client, 0) + change
        if total:
            self._client_bytes[client] = total
        else:
            self._client_bytes.pop(client, None)

    def _client_over_memory(self, client: str | None) -> OwnerMemoryExceeded | None:
        """The refusal for ``client`` when its live episodes keep more than ``max_owner_bytes`` (call with
        ``_lock`` held); None when they do not."""
        kept, limit = self._client_bytes.get(client, 0), self.limits.max_owner_bytes
        if kept <= limit:
            return None
        return OwnerMemoryExceeded(
            f"the live episodes of this client ({client or 'anonymous'}, all its run ids) keep {kept} bytes together, "
            f"over its limit of {limit} bytes (max_owner_bytes); evaluate and release finished episodes before "
            f"creating or stepping more"
        )

    def _capacity_problem(self, client: str | None) -> ManagerError | None:
        """Why a new episode of ``client`` cannot start now, or None (call with ``_lock`` held)."""
        if len(self._slots) >= self.max_episodes:
            return CapacityExceeded(
                f"{len(self._slots)} live episodes (limit {self.max_episodes}); release finished episodes or "
                f"retry later"
            )
        if self._held_by(client) >= self.limits.max_episodes_per_owner:
            return self._client_full(client)
        return self._client_over_memory(client)

    def _ensure_capacity(self, client: str | None = None) -> None:
        with self._lock:
            problem = self._capacity_problem(client)
        if problem is None:
            return
        self.reclaim_idle()  # idle episodes may be what takes the room
        with self._lock:
            problem = self._capacity_problem(client)
        if problem is not None:
            raise problem

    # -- step ----------------------------------------------------------------------------------

    def step(self, instance_id: Any, content: Any, seq: Any = None, owner: str | None = None) -> dict:
        """Apply one assistant message; returns ``{"message", "extra_messages", "terminated", "info"}``.

        ``seq`` (optional): the 0-based index of this step. A retry of the step just applied is
        answered from cache; any other mismatch is a 409 naming the expected value.
        """
        content = _check_content(content)
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 0):
            raise BadRequest(f"'seq' must be a non-negative integer or null, got {seq!r}")
        slot = self._slot(instance_id, owner)
        self._acquire(slot)
        try:
            cached = self._check_seq(slot, seq, content)
            if cached is not None:
                self._touch(slot)
                return copy.deepcopy(cached)
            if slot.terminated or getattr(slot.episode, "terminated", False):
                raise Conflict(
                    f"episode {slot.instance_id!r} has terminated after {slot.steps} steps; evaluate and release it"
                )
            self._check_client_memory(slot.client)
            result = self._guard("step", slot, self._step_episode, slot, content)
            slot.last_step, slot.last_content = result, content  # kept for a retry of this step
            result["info"]["kept_bytes"] += _slot_bytes(slot)
            self._note_kept(slot, result["info"]["kept_bytes"])
            slot.steps += 1
            slot.terminated = bool(result["terminated"])
            self._touch(slot)
        finally:
            self._unlock(slot)
        self._count("steps")
        return copy.deepcopy(result)

    def _check_client_memory(self, client: str | None) -> None:
        """Refuse a step of a client whose live episodes keep more than its budget, before it reaches the episode
        (a step can only add to what they keep; evaluate and release, which free it, are never refused)."""
        with self._lock:
            problem = self._client_over_memory(client)
        if problem is not None:
            raise problem

    def _note_kept(self, slot: _Slot, kept_bytes: int) -> None:
        """Record what the episode keeps after a step in its slot and its client's total."""
        with self._lock:
            if self._slots.get(slot.instance_id) is slot:  # else released meanwhile: out of its client's total already
                self._add_client_bytes(slot.client, kept_bytes - slot.kept_bytes)
            slot.kept_bytes = kept_bytes

    def _check_seq(self, slot: _Slot, seq: int | None, content: str) -> dict | None:
        if seq is None or seq == slot.steps:
            return None
        if seq == slot.steps - 1 and slot.last_step is not None and content == slot.last_content:
            return slot.last_step
        raise Conflict(
            f"step seq {seq} does not match episode {slot.instance_id!r}: {slot.steps} steps "
            f"applied, expected seq {slot.steps}"
        )

    def _step_episode(self, slot: _Slot, content: str) -> dict:
        # Episode.step raises ValueError only for a terminated episode, which step() refuses before
        # getting here; so every exception from it, ValueError included, is a bug (EpisodeFailure).
        result = slot.episode.step(content)
        info = dict(result.info or {})
        info.setdefault("step", slot.steps)
        return json_safe(
            {
                "message": result.message,
                "extra_messages": result.extra_messages,
                "terminated": bool(result.terminated),
                "info": info,
            }
        )

    # -- evaluate / release --------------------------------------------------------------------

    def evaluate(
        self,
        instance_id: Any,
        reward: Any = None,
        release: bool = False,
        owner: str | None = None,
        client: str | None = None,
    ) -> dict:
        """The episode's evaluation (verdict, reward, tags, ...); may be called more than once.

        ``release=True`` also releases the episode once evaluated: the usual end of an episode in one
        round trip instead of two. Its evaluation is kept a while (``EVALUATION_CACHE_TTL_S``) among its client's
        (``client``, default ``owner``: see ``_remember_evaluation``), so a retry after a lost response gets the same
        answer instead of 404.
        """
        reward_cfg = _reward_config(reward)
        client = owner if client is None else client
        fingerprint = json.dumps([owner, reward], sort_keys=True, default=str)
        try:
            slot = self._slot(instance_id, owner)
            self._acquire(slot)
        except UnknownInstance:
            cached = self._earlier_evaluation(client, instance_id, fingerprint)
            if cached is None:
                raise
            return cached
        try:
            result = json_safe(self._guard("evaluate", slot, slot.episode.evaluate, reward_cfg))
            self._touch(slot)
        finally:
            self._unlock(slot)
        self._count("evaluations")
        if release:
            self._remember_evaluation(client, slot.instance_id, fingerprint, result)
            self.release(instance_id, owner)
        return result

    def _remember_evaluation(self, client: str | None, instance_id: str, fingerprint: str, result: dict) -> None:
        """Keep a released episode's evaluation for retries, among its client's (``KeptVerdicts``: budgets per client
        and in total, in verdicts and in bytes; a client that finishes thousands of episodes, or keeps huge verdicts,
        evicts its own, never an innocent's)."""
        with self._lock:
            self._verdicts.put(client, instance_id, fingerprint, result)

    def _earlier_evaluation(self, client: str | None, instance_id: str, fingerprint: str) -> dict | None:
        """The evaluation a released episode of ``client`` answered with the same reward config, while it is kept."""
        with self._lock:
            return self._verdicts.get(client, instance_id, fingerprint)

    def touch(self, instance_id: Any, owner: str | None = None) -> bool:
        """The episode's client is still using it (a generation of its next message is queued or running): it is
        not idle. The idle reclaim is for episodes whose client is gone, and a step of 256 episodes can queue one
        generation longer than ``idle_timeout_s``; the agent loop touches its episode while it waits for one. Never
        waits for a request in flight on the episode (that request marks it used when it ends)."""
        slot = self._slot(instance_id, owner)
        self._touch(slot)
        return True

    def unmake(self, created: dict, owner: str | None = None) -> None:
        """Release the episode a create made for a client that left before its answer (no one knows its id)."""
        if self.release(created.get("instance_id"), owner):
            self._count("abandoned")

    def release(self, instance_id: Any, owner: str | None = None) -> bool:
        """Forget an episode; False when it was not live (already released or reclaimed)."""
        instance_id = check_instance_id(instance_id)
        with self._lock:
            slot = self._slots.get(instance_id)
            if slot is not None and not self._may_use(slot, owner):
                slot = None
            if slot is not None:
                self._unlist(slot)
                self._counts["released"] += 1
        if slot is None:
            return False
        self._close(slot)
        return True

    def _close(self, slot: _Slot) -> None:
        """Free the episode's backends early (the slot is already out of the dict).

        A release racing a request on the episode never pulls the backends from under it, and never waits
        for it (which would hold a shared thread): the request closes the episode when done (``_unlock``).
        """
        close = getattr(slot.episode, "close", None) or (lambda: None)
        if not slot.lock.acquire(blocking=False):
            slot.close_pending = True
            if not slot.lock.acquire(blocking=False):  # still held: its holder sees the flag when done
                return
        try:
            if slot.closed:
                return
            slot.closed = True
            close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.exception("closing episode %s failed", slot.instance_id)
        finally:
            slot.lock.release()

    def reclaim_idle(self, now: float | None = None) -> int:
        """Release episodes idle for longer than ``idle_timeout_s``; returns how many. (The service runs
        this every ``reclaim_interval_s``; a worker that dies is replaced the moment it exits: ``env_service/workers/pool.py``.)"""
        now = self._clock() if now is None else now
        cutoff = now - self.idle_timeout_s
        with self._lock:
            stale = [s for s in self._slots.values() if s.last_access < cutoff]
            reclaimed = []
            for slot in stale:
                # A slot whose lock is held is in use right now: not idle, whatever its timestamp.
                if slot.lock.acquire(blocking=False):
                    slot.lock.release()
                    self._unlist(slot)
                    reclaimed.append(slot)
            self._counts["reclaimed"] += len(reclaimed)
        for slot in reclaimed:
            self._close(slot)
        if reclaimed:
            log.info("reclaimed %d idle episodes", len(reclaimed))
        return len(reclaimed)

    # -- failure profile -----------------------------------------------------------------------

    def set_profile(self, profile: Any, run_id: str | None = None, client: str | None = None) -> dict:
        """Store a run's failure profile; the run's new TRAIN episodes get it (validation never does).

        Profiles are per run (``run_id``; requests naming none share the anonymous one), so one run
        can never change the prompts of another run's episodes. Each is kept as its JSON bytes and counted against
        the client that pushed it (``client``, default the run): ``profile_bytes_kept_per_client`` and, all runs
        together, ``profile_bytes_kept`` (and ``MAX_RUN_PROFILES`` runs).
        """
        if not isinstance(profile, dict):
            raise BadRequest(f"'profile' must be a JSON object, got {type(profile).__name__}")
        try:
            data = json.dumps(profile, allow_nan=False, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except (ValueError, TypeError, RecursionError) as error:
            raise BadRequest(f"'profile' must be plain JSON (no NaN/Infinity): {error}") from None
        if len(data) > MAX_PROFILE_BYTES:
            raise PayloadTooLarge(f"profile is {len(data)} bytes; the limit is {MAX_PROFILE_BYTES} bytes")
        key = run_id or ""
        client = client if client is not None else f"run:{key}"
        size = measured_bytes(data)
        with self._lock:
            self._make_room_for_profile(key, client, size)
            self._profile_version += 1
            version = self._profile_version
            self._profiles.pop(key, None)
            self._profiles[key] = {"data": data, "bytes": size, "client": client, "version": version,
                                   "updated_at": time.time()}  # fmt: skip
        return {"version": version}

    def _make_room_for_profile(self, key: str, client: str, size: int) -> None:
        """Make room for ``key``'s new profile of ``size`` bytes (call with ``_lock`` held), or raise: the client's
        other profiles and this one must fit its budget (429); beyond the runs' or bytes' total, the least recently
        pushed profiles of runs without live episodes are dropped, never one whose episodes run (they would lose their
        cues; 503 then)."""
        others = {k: p for k, p in self._profiles.items() if k != key}
        mine = sum(p["bytes"] for p in others.values() if p["client"] == client)
        if mine + size > self.limits.profile_bytes_kept_per_client:
            raise OwnerMemoryExceeded(
                f"the failure profiles of this client's runs keep {mine} bytes; with this one ({size} bytes) they are "
                f"over its limit of {self.limits.profile_bytes_kept_per_client} bytes (profile_bytes_kept_per_client)"
            )
        live_runs = {slot.run_id or "" for slot in self._slots.values()}
        idle = [k for k in others if k not in live_runs]  # least recently pushed first
        total = sum(p["bytes"] for p in others.values()) + size
        dropped = []
        while (len(others) - len(dropped) >= MAX_RUN_PROFILES or total > self.limits.profile_bytes_kept) and idle:
            dropped.append(idle.pop(0))
            total -= others[dropped[-1]]["bytes"]
        if len(others) - len(dropped) >= MAX_RUN_PROFILES or total > self.limits.profile_bytes_kept:
            raise CapacityExceeded(
                f"runs with live episodes hold failure profiles already ({len(others)} runs, {total - size} bytes; "
                f"limits {MAX_RUN_PROFILES} and profile_bytes_kept {self.limits.profile_bytes_kept}); retry later"
            )
        for k in dropped:
            del self._profiles[k]

    def get_profile(self, run_id: str | None = None) -> dict:
        """The run's latest profile: ``{"profile", "version", "updated_at"}`` (None / 0 / None if never pushed)."""
        with self._lock:
            state = self._profiles.get(run_id or "")
        if state is None:
            return {"profile": None, "version": 0, "updated_at": None}
        return {"profile": json.loads(state["data"]), "version": state["version"], "updated_at": state["updated_at"]}

    # -- stats ---------------------------------------------------------------------------------

    def note_client_error(self) -> None:
        """Counted by the service for every 4xx it answers (visible in /health)."""
        self._count("client_errors")

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
            live = len(self._slots)
            by_mode = {m: 0 for m in EPISODE_MODES}
            for slot in self._slots.values():
                by_mode[slot.mode] += 1
            version = self._profile_version
        return {
            "live": live,
            "live_by_mode": by_mode,
            **counts,
            "max_episodes": self.max_episodes,
            "idle_timeout_s": self.idle_timeout_s,
            "profile_version": version,
            "uptime_s": round(self._clock() - self._started, 3),
        }

    def health(self) -> dict:
        """Whether the episodes can run: ``{"ok", "workers", ...}`` (per worker: alive, busy, answering).

        Cheap and non-blocking (no request to a worker), so probes get an answer even under load; a worker
        counts as answering while it is alive and not past the deadline of the request it is serving.
        """
        if self._pool is None:
            return {"ok": True, "workers": 0}
        return self._pool.health()

    def close_all(self) -> int:
        """Release every live episode and stop the workers (service shutdown)."""
        with self._lock:
            slots = list(self._slots.values())
            self._slots.clear()
            self._requests.clear()
            self._client_bytes.clear()
            self._counts["released"] += len(slots)
        if self._pool is not None:  # stopping the workers frees everything; a hung one must not delay it
            for slot in slots:
                slot.closed = True
            self._pool.close()
            return len(slots)
        for slot in slots:
            self._close(slot)  # never waits for a hung request
        return len(slots)


__all__ = ["MAX_CONTENT_BYTES", "EpisodeManager", "check_instance_id"]
