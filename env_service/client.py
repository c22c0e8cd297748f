"""Clients for the environment service: over HTTP (:class:`EnvClient`) or in-process
(:class:`InProcessEnvClient`), with the same interface and the same results.

Both raise :class:`EnvServiceError` (``status``, ``error`` code, server ``message``) for any refused
request, so calling code handles one exception type whichever transport it uses.

Retries (HTTP only) are bounded and limited to failures where the request may not have been served:
connection errors, read timeouts, 429/502/503/504, and 409 ``episode_busy`` (an earlier attempt of the same
step is still running; the service refuses rather than queues it). Any other 4xx is never retried (the same
request would fail the same way). Retrying a step is safe because the client sends each step's ``seq`` and the manager
answers an already-applied step from cache instead of applying it twice; retrying ``create`` is safe
because the client sends a ``request_id`` chosen up front (the service mints the instance id, and a retry that
overlaps its still-running original waits for it and gets its episode, or 503 ``create_in_progress``); retrying
``evaluate`` is safe because the manager keeps a released episode's evaluation a while (among its client's) and
answers the retry with it.

``run_id`` names the caller's run on every request (failure profiles are per run) and ``secret`` is the
service's shared secret (see ``env_service.http.auth``); both are optional.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from env_service.errors import ManagerError
from env_service.http.auth import AUTH_HEADER, RUN_ID_HEADER, resolve_secret
from env_service.http.endpoints import BY_ROUTE, Caller, Endpoint

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429, 502, 503, 504})
# Failures where the request may not have been served (or its answer was lost).
_RETRYABLE = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class EnvServiceError(Exception):
    """A request the service refused or could not serve.

    ``status``: the HTTP status (the same code in-process); ``None`` when the service was unreachable.
    ``error``: a short machine-readable code (``unknown_task``, ``unknown_instance``, ...).
    """

    def __init__(self, status: int | None, message: str, error: str = "error"):
        super().__init__(f"[{status if status is not None else 'unreachable'}] {error}: {message}")
        self.status = status
        self.error = error
        self.message = message


class _SeqTracker:
    """Next step index per live instance, so retried steps carry the same ``seq``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}

    def reset(self, instance_id: str) -> None:
        with self._lock:
            self._next[instance_id] = 0

    def current(self, instance_id: str) -> int | None:
        with self._lock:
            return self._next.get(instance_id)

    def advance(self, instance_id: str, seq: int | None) -> None:
        with self._lock:
            if seq is not None and self._next.get(instance_id) == seq:
                self._next[instance_id] = seq + 1

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._next.pop(instance_id, None)


class _ClientAPI:
    """The public interface; transports implement ``_call(endpoint, payload)`` and ``_get``."""

    def __init__(self):
        self._seq = _SeqTracker()

    def create(
        self,
        task_id: str,
        mode: str = "train",
        params: dict | None = None,
        request_id: str | None = None,
        memory_snapshot: dict | None = None,
    ) -> dict:
        """Start an episode: ``{"instance_id", "messages", "info"}``. ``memory_snapshot``: the memory an OOD memory
        episode starts from (the ``memory_snapshot`` of the previous prerequisite's evaluation)."""
        # The service mints the instance id; this key, chosen here, lets a retried create find the first attempt.
        request_id = request_id or f"rq_{uuid.uuid4().hex}"
        payload = {"task_id": task_id, "mode": mode, "params": params or {}, "request_id": request_id}
        if memory_snapshot is not None:
            payload["memory_snapshot"] = memory_snapshot
        result = self._call("create", payload)
        self._seq.reset(result["instance_id"])
        return result

    def step(self, instance_id: str, content: str) -> dict:
        """One assistant message: ``{"message", "extra_messages", "terminated", "info"}``."""
        seq = self._seq.current(instance_id)
        result = self._call("step", {"instance_id": instance_id, "content": content, "seq": seq})
        self._seq.advance(instance_id, seq)
        return result

    def evaluate(self, instance_id: str, reward: dict | None = None, release: bool = False) -> dict:
        """The evaluation; ``release=True`` also ends the episode (one round trip for both)."""
        if release:
            self._seq.forget(instance_id)
        return self._call("evaluate", {"instance_id": instance_id, "reward": reward, "release": release})

    def release(self, instance_id: str) -> bool:
        self._seq.forget(instance_id)
        return bool(self._call("release", {"instance_id": instance_id})["released"])

    def touch(self, instance_id: str) -> bool:
        """Tell the service the episode is still in use (the idle reclaim keeps it); a 404 once it is gone."""
        return bool(self._call("touch", {"instance_id": instance_id})["live"])

    def set_profile(self, profile: dict) -> dict:
        return self._call("profile", {"profile": profile})

    def get_profile(self) -> dict:
        return self._get("profile")

    def health(self) -> dict:
        return self._get("health")

    def close(self) -> None:
        """Free transport resources (no-op in-process)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call(self, endpoint: str, payload: dict) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def _get(self, endpoint: str) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


class _SourceAdapter(HTTPAdapter):
    """requests' adapter, its connections leaving from ``source_address`` when one is given."""

    def __init__(self, source_address: str | None, **options):
        self.source_address = source_address  # before HTTPAdapter's __init__, which builds the pool
        super().__init__(**options)

    def init_poolmanager(self, *args, **options):
        if self.source_address is not None:
            options["source_address"] = (self.source_address, 0)
        super().init_poolmanager(*args, **options)


class EnvClient(_ClientAPI):
    """HTTP client. ``pool_size``: keep-alive connections (at least the caller's concurrency).

    ``trust_env``: honour HTTP(S)_PROXY / NO_PROXY / netrc from the environment (off by default).
    ``run_id`` / ``secret``: sent on every request (see the module docstring); ``secret`` defaults to
    ``$SEAL_ENV_SECRET``, as the service's does. ``source_address``: the local address to connect from (a node
    with several; the service counts its limits per client address).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        pool_size: int = 64,
        trust_env: bool = False,
        run_id: str | None = None,
        secret: str | None = None,
        source_address: str | None = None,
    ):
        super().__init__()
        self.url = url.rstrip("/")
        self._headers = {"Accept": "application/json"}
        if run_id:
            self._headers[RUN_ID_HEADER] = run_id
        secret = resolve_secret(secret)
        if secret:
            self._headers[AUTH_HEADER] = f"Bearer {secret}"
        self._json_headers = {**self._headers, "Content-Type": "application/json"}
        self.timeout_s = timeout_s
        self.retries = max(0, int(retries))
        self.backoff_s = backoff_s
        self.session = requests.Session()
        # No proxy/netrc lookups from the environment: they cost ~0.2 ms per request (requests scans
        # os.environ every time), and an env service is reached directly (usually on 127.0.0.1).
        self.session.trust_env = trust_env
        # Retries are ours (below); urllib3's own would also retry 4xx-free POSTs blindly.
        adapter = _SourceAdapter(source_address, pool_connections=1, pool_maxsize=pool_size, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def close(self) -> None:
        self.session.close()

    def _call(self, endpoint: str, payload: dict) -> Any:
        try:
            data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates cannot be UTF-8: send them escaped and let the service refuse them
            # with the same 422 the in-process client gives.
            data = json.dumps(payload).encode("ascii")
        return self._request("POST", endpoint, data)

    def _get(self, endpoint: str) -> Any:
        return self._request("GET", endpoint, None)

    def _prepare(self, method: str, url: str, data: bytes | None) -> requests.PreparedRequest:
        request = requests.PreparedRequest()
        request.prepare_method(method)
        request.prepare_url(url, None)
        request.prepare_headers(self._json_headers if data is not None else self._headers)
        request.prepare_body(data, None)
        return request

    def _request(self, method: str, endpoint: str, data: bytes | None) -> Any:
        url = f"{self.url}/{endpoint}"
        # Sent through the session's pooled adapter directly: Session.request would also merge
        # cookies, hooks, redirects and environment settings we never use (~0.1 ms per call, about
        # a third of the client's cost per request).
        adapter = self.session.get_adapter(url)
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = adapter.send(self._prepare(method, url, data), timeout=self.timeout_s)
                _ = response.content  # read the body here: a connection dropped mid-body is retryable
            except _RETRYABLE as error:
                if last:
                    raise EnvServiceError(
                        None, f"{method} {url} failed after {attempt + 1} attempt(s): {error}", "unreachable"
                    ) from None
                self._sleep(attempt, f"{type(error).__name__} on {endpoint}")
                continue
            if (response.status_code in RETRY_STATUSES or _episode_busy(response)) and not last:
                self._sleep(attempt, f"HTTP {response.status_code} on {endpoint}")
                continue
            return self._decode(response)
        raise AssertionError("unreachable")  # pragma: no cover

    def _sleep(self, attempt: int, why: str) -> None:
        delay = self.backoff_s * (2**attempt)
        log.warning("env service: %s; retrying in %.2f s", why, delay)
        time.sleep(delay)

    @staticmethod
    def _decode(response: requests.Response) -> Any:
        try:
            body = json.loads(response.content) if response.content else None
        except ValueError:  # not JSON (a proxy's HTML error page, a truncated body)
            body = None
        if response.ok and body is not None:
            return body
        if isinstance(body, dict) and "detail" in body:
            raise EnvServiceError(response.status_code, str(body["detail"]), str(body.get("error", "error")))
        text = response.text[:500] if response.text else response.reason
        raise EnvServiceError(response.status_code, text or "empty response", "http_error")


def _episode_busy(response: requests.Response) -> bool:
    """409 ``episode_busy``: this client's earlier attempt of the request is still running (a read timeout
    retried); the service refuses at once rather than queue it, so try again once that attempt answered."""
    return response.status_code == 409 and b'"episode_busy"' in response.content[:64]


class InProcessEnvClient(_ClientAPI):
    """The same interface calling an :class:`EpisodeManager` directly (tests, single machine).

    ``run_id``: as over HTTP, the run whose failure profile this client pushes and its episodes get.
    """

    def __init__(self, manager=None, run_id: str | None = None):
        super().__init__()
        if manager is None:  # imported here: HTTP clients need not load the episodes' code
            from env_service.episodes.manager import EpisodeManager

            manager = EpisodeManager()
        self.manager = manager
        self.run_id = run_id or None

    def _call(self, endpoint: str, payload: dict) -> Any:
        return self._dispatch(BY_ROUTE[("POST", endpoint)], payload)

    def _get(self, endpoint: str) -> Any:
        if endpoint == "health":
            return {"status": "ok", **self.manager.stats()}
        return self._dispatch(BY_ROUTE[("GET", endpoint)], {})

    def _dispatch(self, endpoint: Endpoint, payload: dict) -> Any:
        try:
            return endpoint(self.manager, payload, Caller(self.run_id, self.run_id or "in-process"))
        except ManagerError as error:
            raise EnvServiceError(error.status, error.message, error.code) from None


def make_client(
    url_or_none: str | None = None, manager=None, run_id: str | None = None, secret: str | None = None, **http_options
) -> _ClientAPI:
    """``None`` / ``""`` / ``"inprocess"`` -> :class:`InProcessEnvClient`, else :class:`EnvClient`.

    ``manager`` is for the in-process client; ``run_id`` names the caller's run on both transports;
    ``secret`` and ``http_options`` (``timeout_s=``, ``retries=``, ...) configure the HTTP transport and
    mean nothing in-process, so callers can pass them whatever the URL.
    """
    if url_or_none in (None, "", "inprocess", "in-process", "local"):
        return InProcessEnvClient(manager, run_id=run_id)
    if not str(url_or_none).startswith(("http://", "https://")):
        raise ValueError(f"env service url must start with http:// or https://, got {url_or_none!r}")
    return EnvClient(str(url_or_none), run_id=run_id, secret=secret, **http_options)


class ProfileFanOut:
    """``set_profile`` on every client (one service per node: each must give the run's episodes the
    same profile); the other calls are not fanned out."""

    def __init__(self, clients: list[_ClientAPI]):
        if not clients:
            raise ValueError("ProfileFanOut needs at least one client")
        self.clients = list(clients)

    def set_profile(self, profile: dict) -> list[dict]:
        """Push to all, then raise the first failure (a service that missed it would serve stale cues)."""
        results, errors = [], []
        for client in self.clients:
            try:
                results.append(client.set_profile(profile))
            except EnvServiceError as error:
                errors.append(error)
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        for client in self.clients:
            client.close()


__all__ = ["EnvClient", "EnvServiceError", "InProcessEnvClient", "ProfileFanOut", "make_client"]
