"""Who may use an environment service, as both ends see it: the shared secret and the run id.

* The service listens on loopback unless it is given a secret; with a secret, every endpoint but
  ``OPEN_PATHS`` requires ``Authorization: Bearer <secret>`` (checked in constant time).
* A secret comes from a file (``--secret-file``; readable by its owner only) or the ``SEAL_ENV_SECRET``
  environment variable, never from a command line (other users can read those in ``ps``).
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


def read_secret_file(path: str) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); refused if others may read the file."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as handle:
            secret = handle.read().strip()
    except OSError as error:
        raise ValueError(f"secret file {path!r}: {error.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"secret file {path!r} is accessible to other users; chmod 600 it")
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
    "is_loopback",
    "read_secret_file",
    "resolve_secret",
]
