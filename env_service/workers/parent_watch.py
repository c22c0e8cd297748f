"""A process that exits when the process that started it is gone, however that one ended (SIGKILL included).

The launcher's environment service watches the launcher (``serve --parent-pid``), and every episode worker watches
its service: a killed training run leaves neither behind.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

#: How often the parent is looked for: the longest a child outlives it.
POLL_S = 0.5
#: Exit status of a process whose parent is gone (EX_SOFTWARE would suggest a bug; this is an orphan's end).
EXIT_ORPHANED = 3


def exit_with_parent(parent_pid: int, on_exit: Callable[[], None] | None = None, poll_s: float = POLL_S) -> None:
    """Watch ``parent_pid`` from a daemon thread; once this process is no longer its child, run ``on_exit`` and exit.

    A watchdog thread rather than the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): that signal is
    sent when the *thread* that forked the child exits, and the service starts replacement workers from request
    threads that anyio retires when idle (the launcher restarts its service from a supervising thread): it would
    kill healthy children. ``os.getppid()`` changes when the parent dies (we are re-parented), whatever killed it.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        print(f"parent process {parent_pid} is gone: exiting", file=sys.stderr, flush=True)
        try:
            if on_exit is not None:
                on_exit()
        finally:
            os._exit(EXIT_ORPHANED)  # no clean-up that could wait on whoever is gone

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


__all__ = ["EXIT_ORPHANED", "exit_with_parent"]
