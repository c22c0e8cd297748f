"""Shared fixtures: the offline tiny Qwen model (built once, cached in .cache/tiny-qwen) and its tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = Path(os.environ.get("SEAL_TINY_MODEL_DIR", REPO / ".cache" / "tiny-qwen"))


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves os.environ as it found it: code that sets a run's variables in its own process (the
    launcher's node services) would otherwise hand them to every process a later test starts."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    from seal.cpu.tiny_model import build_tiny_model

    return build_tiny_model(TINY_DIR)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def other_client_address() -> str:
    """A local address beyond loopback: connections to 127.0.0.1 from it are another client to the env service (all
    of loopback is one client). Skips the test on a machine without one."""
    from tests.support.env_attacks import BENCHMARK  # the benchmark's lookup: its innocent and attackers need one too

    address = BENCHMARK.another_client_address()
    if address is None:
        pytest.skip("no local address beyond loopback: a second client needs one")
    return address
