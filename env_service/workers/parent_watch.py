"""A process that exits when the process that started it is gone, however that one ended (SIGKILL included).

The launcher's environment service watches the launcher (``serve --parent-pid``), and every episode worker watches
its service: a killed training run leaves neither behind.

The named process itself is watched, not this process's place in the process tree: a service started through a
wrapper that forks (``sh -c``, a process manager) has the wrapper as its parent, and one whose parent is gone is
re-parented to init (or a subreaper) whatever the named process does. So ``getppid()`` says nothing about the
named process; a descriptor of that process does (a pidfd, Linux 5.3+: it names one process, never a later one that
reuses its pid, and turns readable when it exits), or else its start time in ``/proc`` (a pid reused by another
process has another start time). Where neither is available the option cannot be honoured and is refused at start.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
from collections.abc import Callable

#: How often the watched process is looked at where there is no pidfd to wait on (the longest a child outlives it).
POLL_S = 0.5
#: Exit status of a process whose parent is gone (EX_SOFTWARE would suggest a bug; this is an orphan's end).
EXIT_ORPHANED = 3


class CannotWatch(ValueError):
    """The named process cannot be watched (it does not exist, or this system can tell neither its exit nor its
    identity): a caller that asked to follow it must not start as if it did."""


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks after boot, ``/proc/PID/stat`` field 22), None when it is gone or a
    zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class ProcessWatch:
    """One process, by its identity: :meth:`gone` is True once it has exited, never because its pid was reused.

    Opened at once, so a process that is not there (or cannot be followed here) is refused before anything starts.
    """

    def __init__(self, pid: int):
        if pid <= 0 or pid == os.getpid():
            raise CannotWatch(f"process {pid} cannot be watched: name another process by its pid")
        self.pid = pid
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)
        self._start = _start_time(pid)
        if self._pidfd is None and self._start is None:
            where = (
                "" if os.path.isdir("/proc/self") else " (or this system can follow it neither by a pidfd nor by /proc)"
            )
            raise CannotWatch(f"there is no process {pid}{where}")
        if self._start is None and os.path.isdir("/proc/self"):  # the pidfd names a process that has exited
            self.close()
            raise CannotWatch(f"process {pid} has exited")

    def gone(self) -> bool:
        if self._pidfd is not None:
            return self._readable(0)
        return _start_time(self.pid) != self._start

    def _readable(self, timeout_ms: int | None) -> bool:
        poll = select.poll()  # not select.select: it refuses descriptors from 1024 up
        poll.register(self._pidfd, select.POLLIN)
        return bool(poll.poll(timeout_ms))

    def wait(self, poll_s: float = POLL_S) -> None:
        """Block until the process has exited."""
        while not self.gone():
            if self._pidfd is not None:
                self._readable(None)  # readable when it exits: no polling
            else:
                threading.Event().wait(poll_s)

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def exit_with_parent(parent_pid: int, on_exit: Callable[[], None] | None = None, poll_s: float = POLL_S) -> None:
    """Watch process ``parent_pid`` from a daemon thread; once it has exited, run ``on_exit`` and exit.

    Raises :class:`CannotWatch` at once when the process cannot be watched (see ``ProcessWatch``). ``on_exit`` runs
    only after the watched process is gone, so whatever it removes (the run's secret file) is never removed while
    that process lives.

    A watchdog thread rather than the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): that signal is
    sent when the *thread* that forked the child exits, and the service starts replacement workers from request
    threads that anyio retires when idle (the launcher restarts its service from a supervising thread): it would
    kill healthy children; and it follows the parent, not the named process.
    """
    watch = ProcessWatch(parent_pid)

    def run() -> None:
        watch.wait(poll_s)
        print(f"process {parent_pid}, which this one follows, is gone: exiting", file=sys.stderr, flush=True)
        try:
            if on_exit is not None:
                on_exit()
        finally:
            os._exit(EXIT_ORPHANED)  # no clean-up that could wait on whoever is gone

    threading.Thread(target=run, name="parent-watch", daemon=True).start()


__all__ = ["EXIT_ORPHANED", "CannotWatch", "ProcessWatch", "exit_with_parent"]
