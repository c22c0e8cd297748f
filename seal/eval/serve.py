"""A model served for one evaluation: started, watched and stopped by ``python -m seal.eval endpoint --serve``.

``served(argv, url, log)`` starts the server command (``vllm serve ...``: :func:`vllm_argv`) in its own process
group with its output in ``log``, waits until ``GET {url}/models`` answers (it fails at once, naming the log, when the
server exits first, and after ``startup_s`` when it never answers), yields the URL, and stops the server when the
evaluation ends, however it ends: SIGTERM to its group, SIGKILL after a grace period. The server also gets SIGTERM
from the kernel if this process dies first (``PR_SET_PDEATHSIG``): a killed evaluation leaves no GPU server behind.
A server that dies during the evaluation is named with its log when the evaluation ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import requests

#: vLLM's tool-call parsers for the backbones' formats: Qwen2.5 writes Hermes-style <tool_call> blocks, ToolACE-2
#: Python-style call lists. tau2's agent uses OpenAI function calling; BFCL's categories send no tools.
DEFAULT_TOOL_CALL_PARSER = "hermes"
#: Context of the served model: tau2's conversations run longer than training's 16k.
DEFAULT_MAX_MODEL_LEN = 32768
STARTUP_S = 1800.0  # loading a 7-8B checkpoint and vLLM's warm-up, with room
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 20


class ServeFailed(RuntimeError):
    """The server could not be started, or stopped during the evaluation; the message names its log."""


def vllm_argv(model: str, name: str, port: int, tool_call_parser: str, max_model_len: int) -> list[str]:
    return [
        "vllm",
        "serve",
        model,
        "--served-model-name",
        name,
        "--port",
        str(port),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        tool_call_parser,
        "--max-model-len",
        str(max_model_len),
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def served(argv: list[str], url: str, log: str, startup_s: float = STARTUP_S) -> Iterator[str]:
    """Serve with ``argv`` until the block ends; yields ``url`` once it answers (see the module docstring)."""
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    with open(log, "ab") as out:
        try:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent
            )
        except FileNotFoundError:
            raise ServeFailed(f"cannot start {argv[0]!r}: not installed here (`bash scripts/install.sh gpu`)") from None
    print(f"[seal.eval] serving: {' '.join(argv)} (pid {proc.pid}, log {log})", flush=True)
    try:
        _wait_until_up(proc, url, log, startup_s)
        yield url
        if proc.poll() is not None:
            raise ServeFailed(f"the served model stopped during the evaluation (exit {proc.returncode}); {_tail(log)}")
    finally:
        _stop(proc)


def _wait_until_up(proc: subprocess.Popen, url: str, log: str, startup_s: float) -> None:
    deadline = time.monotonic() + startup_s
    while True:
        if proc.poll() is not None:
            raise ServeFailed(f"the server exited before it answered (exit {proc.returncode}); {_tail(log)}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url.rstrip('/')}/models", timeout=5).ok:
                return
        if time.monotonic() > deadline:
            raise ServeFailed(f"the server did not answer {url}/models within {startup_s:.0f} s; {_tail(log)}")
        time.sleep(1.0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(log: str) -> str:
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()[-LOG_TAIL_LINES:]
    return f"its log {log} ends:\n" + "\n".join(f"    {line}" for line in lines) if lines else f"its log {log} is empty"


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the process that started it dies (Linux; elsewhere, nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
