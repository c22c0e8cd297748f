"""A request whose client is gone: what it started stops where it can, and costs nothing once it has.

The HTTP layer marks a request abandoned the moment its client disconnects (:meth:`Abandon.abandon`). The work the
request runs in a thread sees it through :func:`current` (a context variable: the thread inherits it) and stops
before it starts (:func:`check`) or while it waits for a worker (:meth:`Abandon.wakes`, which wakes that wait), with
:class:`~env_service.errors.ClientGone`. Work already under way finishes; what it made for no one (a created episode)
is released by whoever sees its result (``env_service.http.endpoints.Endpoint.abandoned``).
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar

from env_service.errors import ClientGone


class Abandon:
    """One request's fate: ``gone`` once its client has left; waits registered with :meth:`wakes` are woken then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.gone = False
        self._wakers: list[threading.Event] = []

    def abandon(self) -> None:
        with self._lock:
            self.gone, wakers, self._wakers = True, self._wakers, []
        for event in wakers:
            event.set()

    @contextlib.contextmanager
    def wakes(self, event: threading.Event):
        """While in the block, ``event`` is set the moment the request is abandoned (at once if it is already)."""
        with self._lock:
            if self.gone:
                event.set()
            else:
                self._wakers.append(event)
        try:
            yield
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._wakers.remove(event)


_current: ContextVar[Abandon | None] = ContextVar("env_service_request", default=None)


def current() -> Abandon | None:
    """The fate of the request this thread works for (None outside an HTTP request: nothing ever abandons it)."""
    return _current.get()


@contextlib.contextmanager
def working_for(abandon: Abandon):
    """Run the block (and the threads it starts through anyio) for the request ``abandon`` follows."""
    token = _current.set(abandon)
    try:
        yield
    finally:
        _current.reset(token)


def check() -> None:
    """Raise :class:`ClientGone` when the request this thread works for has been abandoned."""
    abandon = _current.get()
    if abandon is not None and abandon.gone:
        raise ClientGone("the client that sent this request is gone; its work was not started")


__all__ = ["Abandon", "check", "current", "working_for"]
