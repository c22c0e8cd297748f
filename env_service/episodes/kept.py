"""What the service keeps for its clients after their episodes are gone, within budgets in bytes and in counts, per
client and in total.

:class:`KeptVerdicts` holds the evaluations of released episodes, so that an ``evaluate`` retried after a lost answer
gets the same verdict. A verdict is kept as its JSON bytes, and counted by what they measure
(:func:`~env_service.sizes.measured_bytes`): kept as Python objects, the verdict of an out-of-distribution memory
episode (which carries the memory snapshot it hands back) held ~9 MiB for a 1-MiB snapshot, and a budget in verdicts
said nothing about bytes (2,048 such verdicts of one client kept ~19 GiB).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

from env_service.sizes import measured_bytes


@dataclass(frozen=True)
class KeptBudget:
    """How much is kept: at most ``per_client`` items and ``per_client_bytes`` of one client, ``total`` items and
    ``total_bytes`` of all clients together, each for ``ttl_s``."""

    per_client: int
    total: int
    per_client_bytes: int
    total_bytes: int
    ttl_s: float


class KeptVerdicts:
    """Each client's kept verdicts, oldest first. A client over its own budget loses its oldest; when all clients
    together are over theirs, the oldest of the client keeping the most bytes goes (among equals the client adding
    now, which caused it). So a client that finishes thousands of episodes, or keeps huge verdicts, evicts its own,
    never an innocent's. Not thread-safe: the manager calls it under its lock."""

    def __init__(self, budget: KeptBudget, clock=time.monotonic) -> None:
        self.budget, self._clock = budget, clock
        self._kept: dict[
            str | None, OrderedDict[str, tuple[str, bytes, float, int]]
        ] = {}  # ... (tag, json, expiry, bytes)
        self._bytes: dict[str | None, int] = {}
        self.count = 0
        self.total_bytes = 0

    def put(self, client: str | None, key: str, tag: str, verdict: dict) -> None:
        """Keep ``verdict`` (plain JSON) under ``key`` for ``client``, answered again only to the same ``tag``."""
        self.forget_expired()  # of clients that never come back too
        data = json.dumps(verdict, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
        expiry = self._clock() + self.budget.ttl_s
        size = measured_bytes((key, tag, data, expiry))
        self._drop(client, key)
        if size > self.budget.per_client_bytes:
            return  # bigger than all a client may keep: not kept (a retry gets 404, as after expiry)
        self._kept.setdefault(client, OrderedDict())[key] = (tag, data, expiry, size)
        self._bytes[client] = self._bytes.get(client, 0) + size
        self.count += 1
        self.total_bytes += size
        while len(self._kept[client]) > self.budget.per_client or self._bytes[client] > self.budget.per_client_bytes:
            self._drop_oldest(client)
        while self.count > self.budget.total or self.total_bytes > self.budget.total_bytes:
            self._drop_oldest(max(self._kept, key=lambda c: (self._bytes[c], c == client)))

    def get(self, client: str | None, key: str, tag: str) -> dict | None:
        """The verdict kept under ``key`` for ``client`` with ``tag`` (a fresh copy), or None."""
        self.forget_expired()
        kept = self._kept.get(client, {}).get(key)
        if kept is None or kept[0] != tag:
            return None
        return json.loads(kept[1])

    def bytes_of(self, client: str | None) -> int:
        return self._bytes.get(client, 0)

    def count_of(self, client: str | None) -> int:
        return len(self._kept.get(client, ()))

    def forget_expired(self) -> None:
        """Drop every verdict past its time (each client's are in expiry order)."""
        now = self._clock()
        for client in list(self._kept):
            while client in self._kept and next(iter(self._kept[client].values()))[2] < now:
                self._drop_oldest(client)

    def _drop(self, client: str | None, key: str) -> None:
        kept = self._kept.get(client)
        if kept is not None and key in kept:
            self._account(client, kept.pop(key)[3])

    def _drop_oldest(self, client: str | None) -> None:
        self._account(client, self._kept[client].popitem(last=False)[1][3])

    def _account(self, client: str | None, size: int) -> None:
        self.count -= 1
        self.total_bytes -= size
        self._bytes[client] -= size
        if not self._kept[client]:
            del self._kept[client], self._bytes[client]


__all__ = ["KeptBudget", "KeptVerdicts"]
