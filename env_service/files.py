"""Atomic file writes: a reader, or a crash, sees the old file or the whole new one, never half of one.

Used for everything the project writes that someone may read while it is being replaced: the service CLI's
``--output``, the capability state, diagnostic dumps, checkpoint records.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` (same filesystem, so the rename is atomic), fsync it,
    give it the mode ``path`` has or would get from ``open()``, rename it over ``path``, then fsync the directory
    so the rename itself survives a power cut. On any failure the temporary file is removed and ``path`` is
    untouched. The directory must exist."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _new_file_mode(path))  # mkstemp creates 0600; keep the mode a plain write would give
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_write_json(path: str, payload: Any) -> None:
    """`atomic_write_text` of ``payload`` as indented JSON (NaN refused), creating the directory if needed."""
    text = json.dumps(payload, ensure_ascii=False, indent=2, allow_nan=False) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, text)


def _new_file_mode(path: str) -> int:
    """The mode ``path`` has, or would get from ``open()`` under the current umask."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (setting it is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _fsync_dir(directory: str) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # not supported on every filesystem; the file itself is already synced
    finally:
        os.close(dir_fd)
