"""Who may use an environment service, as both ends see it: the shared secret and the run id.

* The service listens on loopback unless it is given a secret; with a secret, every endpoint but
  ``OPEN_PATHS`` requires ``Authorization: Bearer <secret>`` (checked in constant time).
* A secret comes from a file (``--secret-file``; readable by its owner only, in a folder no one else may write, never
  through a symbolic link) or the ``SEAL_ENV_SECRET`` environment variable, never from a command line (other users can
  read those in ``ps``). The launcher writes the file with :func:`open_secret` too.
* Each request may name its run (``X-Seal-Run-Id``): failure profiles and per-client limits are kept
  per run, so one run can never change another run's prompts.
"""

from __future__ import annotations

import ipaddress
import os
import stat

#: Request header carrying the shared secret, as ``Bearer <secret>``.
AUTH_HEADER = "authorization"
#: Request header naming the run a request belongs to.
RUN_ID_HEADER = "x-seal-run-id"
#: Environment variable a secret is read from when no file is given.
SECRET_ENV = "SEAL_ENV_SECRET"
#: Paths answered without the secret (liveness probes; they reveal only counters).
OPEN_PATHS = frozenset({"/health", "/healthz"})


def check_secret_folder(path: str) -> None:
    """Refuse a secret file in a folder that another user may write: they could replace the file, or put a link there
    before it is written (ValueError naming the folder). The folder must be this user's (or root's)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        info = os.stat(folder)
    except OSError as error:
        raise ValueError(f"secret file {path!r}: its folder {folder!r}: {error.strerror}") from None
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or info.st_uid not in (os.geteuid(), 0):
        raise ValueError(
            f"secret file {path!r}: its folder {folder!r} may be written by other users; keep the secret in a folder "
            f"only you can write (chmod 700 or 755)"
        )


def check_secret_handle(path: str, fd: int) -> None:
    """Refuse an open secret file that is not a regular file of this user's, readable by it alone."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"secret file {path!r} is not a regular file")
    if info.st_uid != os.geteuid():
        raise ValueError(f"secret file {path!r} belongs to another user")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"secret file {path!r} is accessible to other users; chmod 600 it")


def open_secret(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` of a secret file where both ends agree: its folder only its user writes, never through a symbolic
    link at the path itself (``O_NOFOLLOW``: a link there is refused, not followed to wherever it points)."""
    check_secret_folder(path)
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as error:
        if os.path.islink(path):
            raise ValueError(f"secret file {path!r} is a symbolic link; refused (name the file itself)") from None
        raise ValueError(f"secret file {path!r}: {error.strerror}") from None


def read_secret_file(path: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); refused if it is a symbolic link, if others may read
    it or write its folder, or if it is not this user's regular file."""
    fd = open_secret(path, os.O_RDONLY)
    try:
        check_secret_handle(path, fd)
        with os.fdopen(fd, encoding="utf-8", closefd=False) as handle:
            secret = handle.read().strip()
    finally:
        os.close(fd)
    if not secret:
        raise ValueError(f"secret file {path!r} is empty")
    return secret


def resolve_secret(secret: str | None = None, secret_file: str | None = None) -> str | None:
    """The secret to use: ``secret``, else the file's, else ``$SEAL_ENV_SECRET``, else None (no secret)."""
    if secret:
        return secret
    if secret_file:
        return read_secret_file(secret_file)
    return os.environ.get(SECRET_ENV) or None


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_bind(host: str, secret: str | None) -> None:
    """Refuse to listen beyond loopback without a secret (anyone who can connect could drive episodes)."""
    if not is_loopback(host) and not secret:
        raise ValueError(
            f"binding {host!r} exposes the service beyond this machine: give a shared secret "
            f"(--secret-file FILE or ${SECRET_ENV}), or bind 127.0.0.1"
        )


__all__ = [
    "AUTH_HEADER",
    "OPEN_PATHS",
    "RUN_ID_HEADER",
    "SECRET_ENV",
    "check_bind",
    "check_secret_folder",
    "check_secret_handle",
    "is_loopback",
    "open_secret",
    "read_secret_file",
    "resolve_secret",
]
