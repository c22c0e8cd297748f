"""Scratch folders of the out-of-distribution episodes: one root per service, removed when the service stops and
swept when the next one starts, so a killed worker (or a killed service) leaves nothing behind for long.

The worker pool makes the root and names it to its workers in ``$SEAL_ENV_SCRATCH``; an episode makes its own
folder inside (:func:`scratch_root`; outside a worker, the system's temporary directory).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SCRATCH_ENV = "SEAL_ENV_SCRATCH"
_PREFIX = "seal-env-"


def make_scratch_root() -> str:
    """A fresh scratch root for this service (named by its pid); first removes the roots of services that are gone."""
    base = Path(tempfile.gettempdir())
    for stale in base.glob(f"{_PREFIX}*-*"):
        pid = stale.name[len(_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def scratch_root() -> str | None:
    """Where an episode makes its scratch folder: the service's root inside a worker, else None (the default)."""
    return os.environ.get(SCRATCH_ENV) or None


__all__ = ["SCRATCH_ENV", "make_scratch_root", "scratch_root"]
