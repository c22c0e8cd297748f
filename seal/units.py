"""Byte sizes as people read them, one spelling for the launcher's estimates and the trainer's error messages."""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


def disk_size(n_bytes: float) -> str:
    """GiB, or MiB below one GiB (the CPU recipes' tiny models)."""
    return gib(n_bytes) if n_bytes >= GIB else f"{n_bytes / MIB:.1f} MiB"
