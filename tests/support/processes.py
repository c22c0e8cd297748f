"""The process table as tests see it (Linux ``/proc``): who started whom, who is still alive, and stopping only the
processes a test started (never every Ray cluster on the machine)."""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

#: The repository whose code the tests' child processes import.
REPO = Path(__file__).resolve().parents[2]


def repo_environment() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``: a child Python imports this tree,
    whichever checkout the installed package points at."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def processes() -> dict[int, dict]:
    """pid -> ``{"ppid", "session", "state", "cmd"}`` of every process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue  # gone while we looked
        found[int(entry.name)] = {"state": fields[0], "ppid": int(fields[1]), "session": int(fields[3]), "cmd": cmd}
    return found


def service_and_workers(parent: int) -> list[int]:
    """The environment service ``parent`` started, then that service's worker processes."""
    table = processes()
    services = [pid for pid, p in table.items() if p["ppid"] == parent and "env_service serve" in p["cmd"]]
    assert len(services) == 1, services
    return services + [pid for pid, p in table.items() if p["ppid"] == services[0]]


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (a zombie has ended)."""
    table = processes()
    return [pid for pid in pids if pid in table and table[pid]["state"] != "Z"]


def wait_for(condition, timeout_s: float, what: str):
    """Poll ``condition`` until it is true (returned) or fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {timeout_s:.0f}s")
        time.sleep(0.2)
    return result


def kill_session(session: int, timeout_s: float = 60.0) -> None:
    """SIGKILL every process of ``session`` (a test's run started with ``start_new_session``: its Ray cluster too)."""
    members = [pid for pid, p in processes().items() if p["session"] == session and pid != os.getpid()]
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not alive(members), timeout_s, f"processes {alive(members)} of session {session} still run")


@functools.cache
def repo_script(relative_path: str):
    """A script or benchmark of this repository (``benchmarks/…``, ``scripts/…``) imported as a module, once per test
    session: they are files, not packages, and several tests use their helpers."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(f"repo_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
