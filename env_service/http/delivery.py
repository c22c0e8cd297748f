"""Whether an answer that made something reached its client: a create whose answer was not taken is undone.

A request whose client leaves while it runs is abandoned (``env_service.abandon``). A client may also leave after the
work is done, before it reads the answer: the answer left, and nothing told the service that no one would learn the
episode's id (before, about a quarter of such creates left an episode live until the idle reclaim, holding one of its
client's slots). What tells, on the connection the answer went out on (:class:`Delivery`, one per connection; the
service's :class:`Deliveries` finds it by the request's addresses):

* its client's kernel resets the connection: it was closed with the answer unread in its receive buffer, or the answer
  arrived after it was closed (Linux answers both with RST), or the client reset it itself (``SO_LINGER`` 0);
* its client closed it (FIN) before taking all of the answer: bytes of it are still in the service's buffers or not
  yet acknowledged (a close after reading sends a FIN once every byte has arrived);
* the service drops it because the answer was not taken (``write_timeout_s``, or room for others' answers);
* it was gone before the answer could be written at all.

What tells that the answer was taken: the client's next request on the connection, its FIN once every byte of the
answer was acknowledged, or the service closing an idle connection. A client that reads an answer and then resets its
connection (instead of closing it) is taken to have left without it: no client of ours does, and the other mistake
leaves an episode for no one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class Delivery:
    """The undos of one connection's answers not yet known to be taken (only the event loop touches it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: list[Callable[[], None]] = []

    def expect(self, undo: Callable[[], None]) -> None:
        self._pending.append(undo)

    def taken(self) -> None:
        self._pending.clear()

    def not_taken(self, why: str) -> None:
        """Undo what each pending answer made (in a thread: an undo may wait for the episode's worker)."""
        pending, self._pending = self._pending, []
        for undo in pending:
            log.info("an answer was not taken (%s): what it made is undone", why)
            self._loop.run_in_executor(None, _logged(undo))

    def __bool__(self) -> bool:
        return bool(self._pending)


def _logged(undo: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            undo()
        except Exception:  # noqa: BLE001 - an undo that fails leaves what the idle reclaim removes
            log.exception("undoing the work of an answer not taken failed")

    return run


class Deliveries:
    """The connections of one server that can carry answers, by their (server address, client address): the app finds
    the connection of a request by its scope's ``server`` and ``client`` (only the event loop touches it)."""

    def __init__(self) -> None:
        self._open: dict[tuple, object] = {}  # key -> the connection (its protocol)
        self.served = False  # set by the protocol that files connections here (an app served otherwise is not followed)

    @staticmethod
    def key(server, client) -> tuple | None:
        return None if server is None or client is None else (tuple(server), tuple(client))

    def opened(self, key: tuple | None, connection) -> None:
        if key is not None:
            self._open[key] = connection

    def closed(self, key: tuple | None, connection) -> None:
        if key is not None and self._open.get(key) is connection:
            del self._open[key]

    def expect(self, scope: dict, undo: Callable[[], None]) -> bool:
        """Undo with ``undo`` the answer about to go out for ``scope``'s request if its client does not take it; False
        (and undone now) when the request's connection is gone or closing already: the answer cannot leave."""
        if not self.served:
            return True
        connection = self._open.get(self.key(scope.get("server"), scope.get("client")))
        if connection is None or not connection.may_answer():
            asyncio.get_running_loop().run_in_executor(None, _logged(undo))
            return False
        connection.delivery.expect(undo)
        return True


__all__ = ["Deliveries", "Delivery"]
