"""The environment service: a FastAPI app over :class:`~env_service.episodes.manager.EpisodeManager`.

Endpoints (routes built from :data:`env_service.http.endpoints.ENDPOINTS`; JSON bodies; responses are JSON; errors are ``{"error": code, "detail": message}``):

=================  ==========================================================  =====================
``POST /create``   ``{task_id, mode: "train"|"validate", params: {}, request_id?}``   ``{instance_id, messages, info}``
``POST /step``     ``{instance_id, content, seq?}``                             ``{message, terminated, info}``
``POST /evaluate`` ``{instance_id, reward?, release?}``                         the evaluation dict
``POST /release``  ``{instance_id}``                                            ``{released: bool}``
``POST /touch``    ``{instance_id}``                                            ``{live: true}`` (404 once gone)
``POST /profile``  ``{profile: {...}}``                                         ``{version}``
``GET /profile``                                                                ``{profile, version, updated_at}``
``GET /health``    (alias ``/healthz``)                                         ``{status: "ok", live, created, ...}``
=================  ==========================================================  =====================

Status codes: 400 bad request, 404 unknown task / instance / route (an episode of another owner reads as
unknown), 409 conflict (a request id reused for another request, stepping a finished episode, wrong ``seq``;
``episode_busy`` while another request on the episode runs), 413 body or content too large, 422 malformed JSON,
wrong field types or invalid config, 429 too many requests in flight for one client, too many run ids for one
address, or a client whose live episodes keep more than ``max_owner_bytes`` (``owner_memory_exceeded``), 503 too
many live episodes or connections, request bodies in flight over their budget (``too_many_bytes_in_flight``) or a
retried create whose original still runs, 411 a body sent without Content-Length, 500 only for a bug on our side
(short message; the traceback goes to the server
log, never into the response).

Compared with the released environment's service: typed per-endpoint bodies instead of one generic envelope, no
``{"success", "data"}`` wrapper, errors never carry tracebacks, and episode work runs in a thread pool
(bfcl backends are synchronous, CPU-bound Python) so the event loop keeps serving other episodes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import inspect
import json
import logging
import socket
import threading
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from env_service import abandon as abandoned
from env_service.abandon import Abandon
from env_service.episodes.manager import EpisodeManager, check_instance_id
from env_service.errors import ManagerError
from env_service.http.auth import AUTH_HEADER, OPEN_PATHS, RUN_ID_HEADER, SECRET_ENV, check_bind
from env_service.http.delivery import Deliveries
from env_service.http.endpoints import ENDPOINTS, Caller, Endpoint
from env_service.http.limits import MAX_BODY_BYTES, HttpLimits, guarded_protocol, peer_key
from env_service.json_safe import sanitise

log = logging.getLogger(__name__)


DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8082


# ---------------------------------------------------------------------------------------------
# Error body (the request and response models are in endpoints.py)
# ---------------------------------------------------------------------------------------------


class ErrorResponse(BaseModel):
    error: str
    detail: str


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class SafeJSONResponse(JSONResponse):
    """Strict JSON that can never fail to render (a render failure would otherwise be a 500)."""

    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
            return json.dumps(sanitise(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode(
                "ascii"
            )


#: Longest ``detail`` of an error body. Details quote what the client sent (an unknown config key, a bad value),
#: which may be a megabyte: like every reply, an error has a bound.
MAX_ERROR_DETAIL_CHARS = 2000


def _error(status: int, code: str, detail: str) -> SafeJSONResponse:
    if len(detail) > MAX_ERROR_DETAIL_CHARS:
        detail = f"{detail[:MAX_ERROR_DETAIL_CHARS]}... [{len(detail) - MAX_ERROR_DETAIL_CHARS} more characters]"
    return SafeJSONResponse({"error": code, "detail": detail}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    """One readable line per problem, e.g. ``content: Input should be a valid string``.

    Built by hand: FastAPI's default echoes the offending input back, which may be megabytes or
    thousands of levels deep (and then fails to encode).
    """
    parts = []
    for err in exc.errors()[:10]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON body ({reason})" if reason else "malformed JSON body")
            continue
        if not loc:  # the body as a whole: missing, or not a JSON object
            parts.append(
                "the request body must be a JSON object sent with Content-Type: application/json"
                + (" (the body was empty)" if err.get("type") == "missing" else "")
            )
            continue
        parts.append(f"{'.'.join(loc)}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request"


# ---------------------------------------------------------------------------------------------
# Body size limit (pure ASGI, so an oversized body is refused before it is buffered or parsed)
# ---------------------------------------------------------------------------------------------


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with 413, whether or not Content-Length is sent."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:  # buffer the (bounded) body, then replay it to the app
            message = await receive()
            if message["type"] == "http.disconnect":  # the client left (or was timed out) mid-body
                return None
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        response = _error(
            413,
            "payload_too_large",
            f"request body exceeds {self.limit} bytes; assistant content is limited to 256 KiB",
        )
        await response(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# Access control (pure ASGI: an unauthenticated request costs no body read and no parsing)
# ---------------------------------------------------------------------------------------------


class SecretMiddleware:
    """Refuse every request but ``OPEN_PATHS`` without ``Authorization: Bearer <secret>`` (401)."""

    def __init__(self, app, secret: str):
        self.app = app
        self.expected = b"Bearer " + secret.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers") or () if k == AUTH_HEADER.encode()), b"")
        if hmac.compare_digest(given, self.expected):  # constant time: no timing oracle on the secret
            return await self.app(scope, receive, send)
        response = _error(
            401,
            "unauthorized",
            f"this service requires its shared secret: send 'Authorization: Bearer <secret>' "
            f"(the client takes secret=..., or reads ${SECRET_ENV})",
        )
        await response(scope, receive, send)


def _run_id(request: Request) -> str | None:
    """The caller's run id (header), or None; validated like an instance id (it keys server state)."""
    value = request.headers.get(RUN_ID_HEADER)
    return None if value is None else check_instance_id(value, what="run id")


def _peer(request: Request) -> str:
    return peer_key(request.client.host) if request.client else "?"


class RunIdsPerPeer:
    """The run ids each client address used lately, at most ``limit`` at once (see ``HttpLimits``)."""

    def __init__(self, limit: int, forget_after_s: float, clock=time.monotonic):
        self.limit, self.forget_after_s, self._clock = limit, forget_after_s, clock
        self._seen: dict[str, collections.OrderedDict[str, float]] = {}  # peer -> run id -> last seen
        self.refusal = (
            f"this client address uses {limit} run ids already, its limit; reuse one (a run id is forgotten "
            f"{forget_after_s:g} s after its last request)"
        )

    def admit(self, peer: str, run_id: str) -> bool:
        now = self._clock()
        seen = self._seen.setdefault(peer, collections.OrderedDict())
        if run_id not in seen:
            while seen and next(iter(seen.values())) < now - self.forget_after_s:
                seen.popitem(last=False)  # oldest first: entries are in last-seen order
            if len(seen) >= self.limit:
                return False
        seen[run_id] = now
        seen.move_to_end(run_id)
        return True


def _client(request: Request) -> str:
    """Whom the limits that protect other clients count a request against: its address (``peer_key``), whatever run
    ids it names. Run ids only partition what one client does (whose episodes, whose failure profile): a client
    naming 4 run ids must not hold 4 shares of the service."""
    return f"addr:{_peer(request)}"


def _owner(request: Request, run_id: str | None) -> str:
    """Who may use an episode: the run, else the client.

    Each source has its own prefix, so a run id spelled like an address (``addr:loopback``) is another owner.
    """
    return f"run:{run_id}" if run_id is not None else _client(request)


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def create_app(
    manager: EpisodeManager | None = None,
    secret: str | None = None,
    service_id: str | None = None,
    limits: HttpLimits | None = None,
) -> FastAPI:
    """The FastAPI app. ``manager``: share one with other code (tests); default: a fresh one.

    ``secret``: required on every endpoint but ``OPEN_PATHS``. ``service_id``: echoed by ``/health`` so
    whoever started this service can tell it from another one answering on the same port.
    """
    manager = manager or EpisodeManager()
    limits = limits or HttpLimits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # One thread per connection that can carry a request: a request waiting for its episode's worker (served
        # lightest owner first, env_service.workers.fair_gate) holds a thread of its own, never one another client needs.
        # Blocked threads cost little (2,048 of them: ~32 MiB); the GIL bounds the parallelism anyway.
        app.state.limiter = anyio.CapacityLimiter(limits.max_connections)
        # Before the first request: a cold task table hit by many concurrent creates is built once.
        await anyio.to_thread.run_sync(manager.warm_up)
        reclaimer = asyncio.create_task(_reclaim_loop(manager, app.state.limiter))
        try:
            yield
        finally:
            reclaimer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reclaimer
            released = manager.close_all()
            if released:
                log.info("shutdown: released %d live episodes", released)

    app = FastAPI(
        title="seal env service",
        summary="BFCL V3 multi-turn episodes for RL rollouts",
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
    )
    app.state.manager = manager
    app.state.limiter = None
    app.state.http_limits = limits
    app.state.in_flight = collections.Counter()  # client -> requests in flight
    app.state.run_ids = RunIdsPerPeer(limits.max_run_ids_per_peer, manager.idle_timeout_s)
    app.state.service_id = service_id
    app.state.deliveries = Deliveries()  # the connections answers leave on (the served protocol files them)
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_body_bytes)
    if secret:  # added last: outermost, so the secret is checked before a body is read
        app.add_middleware(SecretMiddleware, secret=secret)
    _install_error_handlers(app, manager)
    _install_routes(app, manager)
    return app


async def _reclaim_loop(manager: EpisodeManager, limiter) -> None:
    while True:
        await asyncio.sleep(manager.reclaim_interval_s)
        try:
            await anyio.to_thread.run_sync(manager.reclaim_idle, limiter=limiter)
        except Exception:  # noqa: BLE001 - the loop must survive anything
            log.exception("idle reclaim failed")


async def _run(request: Request, endpoint: Endpoint, manager: EpisodeManager, body: dict, caller: Caller, free):
    """Run the endpoint's manager work in a thread; map errors to clean JSON responses.

    The moment the request's client disconnects, what the request holds here (its place among its client's requests in
    flight) is freed (``free``, called once), and its work is dropped before it starts or while it waits for a worker;
    work already under way finishes, and what it made for no one is undone (``Endpoint.undo``: an episode created for
    a client that left is released at once). Before, it kept its slot until the work was done, and the episode lived
    until the idle reclaim."""
    abandon = Abandon()

    def client_gone(watch: asyncio.Task) -> None:
        if not watch.cancelled():
            abandon.abandon()
            free()

    watch = asyncio.ensure_future(_disconnected(request))
    watch.add_done_callback(client_gone)
    try:
        result, error = await _in_thread(request, endpoint, manager, body, caller, abandon)
    finally:
        watch.cancel()
    if not abandon.gone and not _undone_unless_taken(request, endpoint, manager, result, error, caller):
        return _response(manager, request, result, error)
    if error is None and endpoint.undo is not None:  # finished as its client left: its thread may have missed it
        await anyio.to_thread.run_sync(endpoint.abandoned, manager, result, caller, limiter=request.app.state.limiter)
    return _error(499, "client_gone", "the client disconnected before its answer")


def _undone_unless_taken(request: Request, endpoint: Endpoint, manager, result, error, caller: Caller) -> bool:
    """Have what this answer made (a created episode) undone if its client does not take the answer: it leaves
    after the work is done, before reading (``env_service.http.delivery``). True when the connection is gone already
    (undone now: the answer cannot leave)."""
    if error is not None or endpoint.undo is None:
        return False
    return not request.app.state.deliveries.expect(request.scope, lambda: endpoint.abandoned(manager, result, caller))


async def _in_thread(
    request: Request, endpoint: Endpoint, manager: EpisodeManager, body: dict, caller: Caller, abandon: Abandon
):
    """``(result, None)`` or ``(None, error)`` of the endpoint's work, run in a thread for the request ``abandon``
    follows (the pool's waits see it); what it made is undone there if its client left while it ran (an undo is
    idempotent: a second release of an episode finds it gone)."""

    def call():
        with abandoned.working_for(abandon):
            if endpoint.abandonable:
                abandoned.check()
            result = endpoint(manager, body, caller)
        if abandon.gone:
            endpoint.abandoned(manager, result, caller)
        return result

    try:
        return await anyio.to_thread.run_sync(call, limiter=request.app.state.limiter), None
    except Exception as error:  # noqa: BLE001 - answered by _response
        return None, error


async def _disconnected(request: Request) -> None:
    """Returns once the request's client has disconnected (the body has been read: nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _response(manager: EpisodeManager, request: Request, result, error: Exception | None):
    if error is None:
        return SafeJSONResponse(result)
    if isinstance(error, ManagerError):
        if error.status < 500:
            manager.note_client_error()
        return _error(error.status, error.code, error.message)
    log.error("unexpected error in %s", request.url.path, exc_info=error)  # the client sees no internals
    return _error(500, "internal_error", "internal server error; see the service log")


def _route(manager: EpisodeManager, endpoint: Endpoint):
    """The route function of ``endpoint``: ``(body, request)`` for a POST, ``(request)`` for a GET."""

    async def route(request: Request, body: BaseModel | None = None):
        run_id = _run_id(request)  # validated here: a bad run id header is a 400 before any work
        if run_id is not None and not request.app.state.run_ids.admit(_peer(request), run_id):
            manager.note_client_error()
            return _error(429, "too_many_run_ids", request.app.state.run_ids.refusal)
        caller = Caller(run_id, _owner(request, run_id), _client(request))
        # Counted on the event loop (one thread): no lock needed.
        in_flight, limit = request.app.state.in_flight, request.app.state.http_limits.max_requests_per_owner
        if in_flight[caller.client] >= limit:
            manager.note_client_error()
            return _error(
                429,
                "too_many_requests",
                f"{limit} requests of this client (all its run ids) are in flight already; wait",
            )
        in_flight[caller.client] += 1
        holding = True

        def free() -> None:  # once: when the answer is ready, or when the client leaves before it
            nonlocal holding
            if holding:
                holding = False
                in_flight[caller.client] -= 1
                if not in_flight[caller.client]:
                    del in_flight[caller.client]

        try:
            return await _run(request, endpoint, manager, {} if body is None else dict(body), caller, free)
        finally:
            free()

    parameters = [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)]
    if endpoint.body is not None:  # FastAPI reads the body model from the signature
        parameters.insert(
            0, inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=endpoint.body)
        )
    route.__signature__ = inspect.Signature(parameters)
    return route


def _install_routes(app: FastAPI, manager: EpisodeManager) -> None:
    errors = {
        400: {"model": ErrorResponse},
        404: {"model": ErrorResponse},
        409: {"model": ErrorResponse},
        413: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    }
    for endpoint in ENDPOINTS:
        app.add_api_route(
            f"/{endpoint.path}",
            _route(manager, endpoint),
            methods=[endpoint.method],
            name=endpoint.manager_method,
            response_model=endpoint.response,
            responses=errors if endpoint.body is not None else None,
        )

    async def health():
        # Stats take only the manager's short dict lock: answer on the loop, even when the pool
        # is saturated, so liveness probes never time out under load.
        # "degraded" (503) while a worker process is dead or past the deadline of the request it serves.
        workers = manager.health()
        return SafeJSONResponse(
            {
                "status": "ok" if workers["ok"] else "degraded",
                "service_id": app.state.service_id,
                **manager.stats(),
                "workers": workers,
            },
            status_code=200 if workers["ok"] else 503,
        )

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/healthz", health, methods=["GET"], include_in_schema=False)


def _install_error_handlers(app: FastAPI, manager: EpisodeManager) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        manager.note_client_error()
        return _error(422, "invalid_request", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        if exc.status_code < 500:
            manager.note_client_error()
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed"}
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 400 and "parsing the body" in detail:
            detail = "could not parse the request body: send UTF-8 encoded JSON"
        return _error(exc.status_code, codes.get(exc.status_code, "http_error"), detail)

    @app.exception_handler(ManagerError)
    async def on_manager(request: Request, exc: ManagerError):
        return _error(exc.status, exc.code, exc.message)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.error("unexpected error in %s: %r", request.url.path, exc)
        return _error(500, "internal_error", "internal server error; see the service log")


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------


def _uvicorn_config(app, host: str, port: int, log_level: str, access_log: bool, limits: HttpLimits):
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        http=guarded_protocol(limits, app.state.deliveries),
        # No WebSocket endpoints: an upgrade request is plain HTTP (404). With upgrades on, uvicorn handed the
        # connection to its WebSocket protocol, beyond every limit here and without closing its record: each
        # upgrade from loopback held a connection slot for good, and 1,024 of them locked loopback out.
        ws="none",
        timeout_keep_alive=limits.keep_alive_s,
        limit_concurrency=limits.max_connections,
    )


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    log_level: str = "info",
    manager: EpisodeManager | None = None,
    access_log: bool = False,
    secret: str | None = None,
    service_id: str | None = None,
    limits: HttpLimits | None = None,
    workers: int | None = None,
    fd: int | None = None,
) -> None:
    """Run the service in the foreground (blocks). Binds to 127.0.0.1 unless told otherwise; any other
    address needs ``secret`` (see :func:`check_bind`). ``workers``: episode processes when no ``manager``
    is given (default: :func:`~env_service.workers.sizing.size_workers`, one per usable CPU within a share of the
    memory). ``fd``: a listening socket inherited from whoever started the service (``serve --fd``), served instead
    of binding ``host``/``port``: its owner keeps the port across restarts."""

    import uvicorn

    sockets = None
    if fd is not None:
        sockets = [socket.socket(fileno=fd)]
        host, port = sockets[0].getsockname()[:2]
    check_bind(host, secret)
    if manager is None:
        from env_service.workers.sizing import size_workers

        manager = EpisodeManager(workers=size_workers().workers if workers is None else workers)
    limits = limits or HttpLimits()
    app = create_app(manager, secret=secret, service_id=service_id, limits=limits)
    uvicorn.Server(_uvicorn_config(app, host, port, log_level, access_log, limits)).run(sockets=sockets)


class ServerThread:
    """A real uvicorn server on an ephemeral port in a background thread (tests, benchmarks).

    >>> with ServerThread() as server:
    ...     EnvClient(server.url).health()
    """

    def __init__(
        self,
        manager: EpisodeManager | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        log_level: str = "warning",
        secret: str | None = None,
        service_id: str | None = None,
        limits: HttpLimits | None = None,
    ):
        import uvicorn

        check_bind(host, secret)
        limits = limits or HttpLimits()
        self.manager = manager or EpisodeManager()
        self.app = create_app(self.manager, secret=secret, service_id=service_id, limits=limits)
        # proto must be IPPROTO_TCP explicitly: asyncio enables TCP_NODELAY on accepted connections
        # only for sockets that say so, and with Nagle on every response waits ~40 ms for an ACK.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.server = uvicorn.Server(_uvicorn_config(self.app, host, self.port, log_level, False, limits))
        self._thread = threading.Thread(target=self._run, name="env-service", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.server.run(sockets=[self._socket])

    def start(self, timeout_s: float = 120.0) -> ServerThread:  # start-up loads the task table in every worker
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("env service thread failed to start")
            time.sleep(0.01)
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and self.server.started and not self.server.should_exit

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        with contextlib.suppress(OSError):
            self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "SecretMiddleware",
    "BodyLimitMiddleware",
    "ServerThread",
    "create_app",
    "serve",
]
