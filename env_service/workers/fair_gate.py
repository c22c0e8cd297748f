"""Whose request a busy worker serves next: the owner that used the workers least lately.

A worker process runs one request at a time. With a plain lock, an owner (a run, or a client address) that keeps
dozens of budget-busting messages queued on a worker makes every other owner's step wait behind all of them: 24
such episodes put an innocent step at 12x the message budget. :class:`FairGate` serialises a worker's requests like
a lock, but when it frees it is handed to the waiting request whose owner has the least *recent usage* — worker
seconds, decayed with a half-life of ``USAGE_HALF_LIFE_S`` (:class:`Usage`, shared by all the workers of a pool).
An owner that sends cheap steps is always served before one that burns its budgets, so an innocent step waits at
most for the request running when it arrived (one budget) and for the few owners lighter than itself. Ties go to
the earlier request; requests with no owner (in-process callers) are one owner, ``None``.

Minting owners does not buy priority for long: each new owner pays for its first heavy request with usage that
takes several half-lives to decay below an innocent client's.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Hashable

from env_service.abandon import Abandon

#: How fast past usage is forgiven: long enough that an owner's heavy requests weigh on many of its next ones,
#: short enough that a run that was busy a minute ago competes on equal terms again.
USAGE_HALF_LIFE_S = 30.0
#: Owners whose decayed usage fell below this many seconds are forgotten (the table stays small).
_FORGOTTEN_BELOW_S = 1e-3
_PRUNE_EVERY = 256


class Usage:
    """Worker seconds per owner, each decayed with half-life ``half_life_s`` since it was last charged."""

    def __init__(self, half_life_s: float = USAGE_HALF_LIFE_S, clock=time.monotonic):
        self._rate = math.log(2) / half_life_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds: dict[Hashable, tuple[float, float]] = {}  # owner -> (usage, when it was last charged)
        self._charges = itertools.count(1)

    def _decayed(self, owner: Hashable, now: float) -> float:
        usage, at = self._seconds.get(owner, (0.0, now))
        return usage * math.exp(-self._rate * (now - at))

    def of(self, owner: Hashable) -> float:
        with self._lock:
            return self._decayed(owner, self._clock())

    def charge(self, owner: Hashable, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            self._seconds[owner] = (self._decayed(owner, now) + max(seconds, 0.0), now)
            if next(self._charges) % _PRUNE_EVERY == 0:
                self._seconds = {o: v for o, v in self._seconds.items() if self._decayed(o, now) >= _FORGOTTEN_BELOW_S}

    def lightest(self, owners: list[Hashable]) -> int:
        """Index of the owner in ``owners`` with the least usage (the first among equals)."""
        with self._lock:
            now = self._clock()
            return min(range(len(owners)), key=lambda k: self._decayed(owners[k], now))


class _Waiter:
    __slots__ = ("owner", "granted", "event")

    def __init__(self, owner: Hashable):
        self.owner, self.granted, self.event = owner, False, threading.Event()


class FairGate:
    """A lock whose waiters are served lightest owner first (see the module docstring).

    ``acquire(owner, timeout)`` / ``release()`` like ``threading.Lock``; ``try_acquire()`` never waits. The holder
    is not tracked: whoever acquired it releases it, as with a lock.
    """

    def __init__(self, usage: Usage):
        self.usage = usage
        self._lock = threading.Lock()
        self._held = False
        self._waiters: list[_Waiter] = []  # in arrival order, so ties go to the earlier request

    def try_acquire(self) -> bool:
        with self._lock:
            if self._held:
                return False
            self._held = True
            return True

    def acquire(self, owner: Hashable = None, timeout: float | None = None, abandon: Abandon | None = None) -> bool:
        """True once held; False after ``timeout``, or as soon as ``abandon`` says the request's client is gone."""
        waiter = _Waiter(owner)
        with self._lock:
            if not self._held:
                self._held = True
                return True
            self._waiters.append(waiter)
        with abandon.wakes(waiter.event) if abandon is not None else contextlib.nullcontext():
            waiter.event.wait(timeout)
        with self._lock:
            if waiter.granted:  # handed over (perhaps just as the wait ended): ours after all
                return True
            self._waiters.remove(waiter)
            return False

    def release(self) -> None:
        with self._lock:
            if not self._waiters:
                self._held = False
                return
            # Handed straight to the next holder (it stays held), so no newcomer slips in between.
            waiter = self._waiters.pop(self.usage.lightest([w.owner for w in self._waiters]))
            waiter.granted = True
            waiter.event.set()

    def waiting(self) -> int:
        """Requests waiting for the gate now."""
        with self._lock:
            return len(self._waiters)


__all__ = ["USAGE_HALF_LIFE_S", "FairGate", "Usage"]
