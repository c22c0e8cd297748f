"""The run's environment services: started, recognised, supervised and stopped here; found by the agent loop.

``environment_service`` is the run's: the service named by ``env_service.url``, or services started for this run
only and stopped with it. One node: the launcher starts one ``python -m env_service serve`` on 127.0.0.1 (a free
port unless ``env_service.port`` names one). On a Ray cluster (``seal.launch.multinode.on_a_cluster``): one service
per node, each on its own node's loopback and owned by a Ray actor pinned to that node; ``env_service.nodes`` maps
Ray node id -> URL; how the run's workers find them is :mod:`seal.env_clients`. Each is supervised
(``LocalService.supervise``: restarted when it dies or hangs, within a budget), on a port its owner holds; one past
its budget stops the run (``RunStopped``, naming it and its log).

Every service gets the run's shared secret (a file only its owner can read, never a command-line
argument or a log line) and a fresh service id that ``/health`` echoes: a different server answering on
the same port is refused, never used.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from omegaconf import DictConfig

from env_service.client import EnvClient, EnvServiceError, make_client
from env_service.http.auth import check_secret_handle, open_secret
from env_service.workers.sizing import WorkerSizing, size_workers
from seal.env_clients import ACTOR_NAMESPACE, actor_name
from seal.launch.recipe import REPO_ROOT, PreflightError
from seal.launch.run_env import connect_ray

LOOPBACK = "127.0.0.1"
#: How long Ray may take to start the actor that owns a node's service (its worker process, imports): the 300 s the
#: launcher waited for node services before their start wait was sized, less the 120 s service wait that held.
ACTOR_START_S = 180.0
#: Connections a service's port queues while no service accepts them (a restart): they are served once it is up.
BACKLOG = 2048


class ServiceStartError(RuntimeError):
    """A service of the run did not come up (or another server answered in its place)."""


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def new_service_id() -> str:
    return secrets.token_hex(8)


def write_secret(path: str | os.PathLike, secret: str) -> str:
    """Write ``secret`` to ``path``, readable by its owner only: created 0600, in a folder no other user may write,
    never through a symbolic link at ``path`` (refused: it could point anywhere). ValueError says what is wrong."""
    path = str(path)
    fd = open_secret(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(fd, 0o600)  # an existing file keeps its old mode through O_CREAT
        check_secret_handle(path, fd)
        handle.write(secret)
    return path


def listen(host: str = LOOPBACK, port: int | None = None) -> socket.socket:
    """A listening socket on ``host``:``port`` (a free port when None) for a service to serve (``serve --fd``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port its last service left in TIME_WAIT
        sock.bind((host, int(port or 0)))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ServiceStartError(
            f"env_service.port {port} on {host} is taken by another server ({exc.strerror}): set env_service.port=null "
            "(a free port) or free the port"
        ) from None
    return sock


def serve_flags(options) -> list[str]:
    """``env_service.serve`` (``{workers: 2, read_timeout_s: 10, ...}``) as ``serve`` flags; nulls are left out."""
    flags = []
    for key, value in dict(options or {}).items():
        if value is not None:
            flags += ["--" + str(key).replace("_", "-"), str(value)]
    return flags


def _options(flags: list[str]) -> dict:
    """:func:`serve_flags` back as options: ``["--peak-episodes", "256"]`` -> ``{"peak_episodes": "256"}``."""
    return {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])}


# ---- what the run asks of its services -------------------------------------------------------------------


def serve_options(config) -> dict:
    """``env_service.serve`` of the recipe, with ``peak_episodes`` the recipe's (:func:`peak_episodes`) when null: the
    service then holds the trainer's concurrency (``HttpLimits.serving``)."""
    from omegaconf import OmegaConf

    options = dict(OmegaConf.to_container(config.env_service.serve, resolve=True) or {})
    if options.get("peak_episodes") is None:
        options["peak_episodes"] = peak_episodes(config)
    return options


def service_workers(options: dict) -> WorkerSizing:
    """The workers a service started with ``options`` (:func:`serve_options`) runs on this node, and why:
    ``env_service.serve.workers`` when set, else sized for this node (``size_workers``) as ``serve`` would."""
    if options.get("workers") is not None:
        return WorkerSizing(int(options["workers"]), "env_service.serve.workers")
    peak = options.get("peak_episodes")
    return size_workers(None if peak is None else int(peak))


def peak_episodes(config) -> int:
    """The most episodes the trainer runs at once: a training step's (``train_batch_size`` x ``rollout.n``, with
    REMAX's greedy baselines) or a validation batch's (``val_batch_size``, else every validation row, padded to a
    multiple of the agent-loop workers as verl pads it, x ``val_kwargs.n``), whichever is larger. Every episode of
    a batch starts at once (verl gathers them all)."""
    rollout = config.actor_rollout_ref.rollout
    train = int(config.data.train_batch_size) * int(rollout.n)
    if str(config.algorithm.adv_estimator) == "remax":
        train += int(config.data.train_batch_size)
    trainer = config.trainer
    if not (trainer.get("val_before_train") or int(trainer.get("test_freq") or 0) > 0 or trainer.get("val_only")):
        return train
    from seal.launch.memory_estimate import data_rows

    rows = data_rows(config.data.val_files)
    batch = int(config.data.val_batch_size) if config.data.get("val_batch_size") else rows
    batch = min(batch, rows) if rows else batch
    workers = max(int(rollout.agent.num_workers), 1)
    padded = -(-batch // workers) * workers
    return max(train, padded * int(rollout.val_kwargs.n))


class LocalService:
    """A ``python -m env_service serve`` process of this run, on this machine's loopback.

    It exits with the process that started it (``--parent-pid``: a killed launcher leaves no service behind), and
    :meth:`supervise` restarts it when it dies or answers nothing: same address, secret and identity, so the run's
    clients reach the new one; the episodes it held fail (the run retries them, then counts them as environment
    failures). The port is this object's, not the service's: the socket is bound here once and inherited by every
    service started on it (``serve --fd``), so no other server can take the port between a service and its
    replacement, and clients' connections made meanwhile wait in its queue for the replacement instead of failing.
    """

    def __init__(
        self,
        secret_file: str,
        service_id: str,
        port: int | None = None,
        flags: list[str] = (),
        log_path: str | os.PathLike | None = None,
        host: str = LOOPBACK,
    ):
        self._listener = listen(host, port)
        self.host, self.port = host, self._listener.getsockname()[1]
        self.secret_file, self.service_id = secret_file, service_id
        self.flags, self.log_path = list(flags), log_path
        # Sized here, on the node it runs on, and passed on: the service starts the workers its start wait is for.
        self.workers = service_workers(_options(self.flags))
        if "--workers" not in self.flags:
            self.flags += ["--workers", str(self.workers.workers)]
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.gave_up: str | None = None  # why supervision ended with the service down (its restart budget spent)
        self._lock = threading.Lock()  # the process is replaced by the supervisor and stopped by the owner
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> str:
        log = f", log {self.log_path}" if self.log_path else ""
        return f"the environment service at {self.url} (pid {self.proc.pid if self.proc else '-'}{log})"

    def start(self, timeout_s: float | None = None) -> LocalService:
        """Start the service and wait for its ``/health`` (``timeout_s``; None: as long as its workers need)."""
        proc = self._spawn()
        try:
            wait_healthy(self.url, proc, self.service_id, timeout_s or self.workers.start_wait_s)
        except BaseException:
            _terminate(proc)
            raise
        return self

    def _spawn(self) -> subprocess.Popen:
        fd = self._listener.fileno()
        command = [
            sys.executable,
            "-m",
            "env_service",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--fd",
            str(fd),
            "--secret-file",
            self.secret_file,
            "--service-id",
            self.service_id,
            "--parent-pid",
            str(os.getpid()),
            *self.flags,
        ]
        with self._lock:
            if self._stopping.is_set():
                raise ServiceStartError("the environment service is being stopped")
            log = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
            try:
                self.proc = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, pass_fds=(fd,)
                )
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()
            return self.proc

    def supervise(
        self, report=print, on_give_up=None, max_restarts: int = 5, unresponsive_s: float = 60.0, poll_s: float = 1.0
    ) -> LocalService:
        """Restart the service whenever it exits or answers ``/health`` nothing (no HTTP answer at all: 503 is one)
        for ``unresponsive_s``, until :meth:`stop`, at most ``max_restarts`` times in all; ``report`` gets one line
        per event. Past the budget, with the service down, the port is closed (its clients fail at once instead of
        waiting out their timeouts), ``gave_up`` says why, and ``on_give_up(why)`` is called."""
        self._supervisor = threading.Thread(
            target=self._supervise,
            args=(report, on_give_up, max_restarts, unresponsive_s, poll_s),
            name="env-service-supervisor",
            daemon=True,
        )
        self._supervisor.start()
        return self

    def _supervise(self, report, on_give_up, max_restarts: int, unresponsive_s: float, poll_s: float) -> None:
        probe = HealthProbe(self.url, unresponsive_s)
        while not self._stopping.wait(poll_s):
            code, silent_s = self.proc.poll(), None
            if code is None:
                silent_s = probe.silent_for()
                if silent_s is None:
                    continue
            if self._stopping.is_set():
                return
            what = f"exited with code {code}" if code is not None else f"answered nothing for {silent_s:.0f}s"
            if self.restarts >= max_restarts:
                self._give_up(
                    f"{self.describe()} {what} after {self.restarts} restart(s), the most "
                    "env_service.supervise.max_restarts allows: the run stops",
                    report,
                    on_give_up,
                )
                return
            report(f"{self.describe()} {what}; restarting it (its episodes in flight fail)")
            self.restarts += 1
            _terminate(self.proc, grace_s=0 if code is None else 10)  # a wedged one may not heed SIGTERM
            try:
                self.start()
            except (ServiceStartError, OSError) as exc:
                if self._stopping.is_set():
                    return
                report(f"could not restart the environment service: {exc}")
                continue  # the dead process is seen again at the next poll, and retried within the budget
            probe.reset()
            report(f"{self.describe()} restarted ({self.restarts} restart(s) in this run)")

    def _give_up(self, why: str, report, on_give_up) -> None:
        self.gave_up = why
        _terminate(self.proc, grace_s=0)
        self._listener.close()
        report(why)
        if on_give_up is not None:
            on_give_up(why)

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:  # no new process after this: a restart in progress fails at its next health check
            proc = self.proc
        _terminate(proc)
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join()
        self._listener.close()


class HealthProbe:
    """Whether a service has answered ``/health`` lately: any HTTP answer counts (503 ``degraded`` is a service
    replacing a worker, alive); a timeout or a refused connection does not. Probes run at most every few seconds."""

    def __init__(self, url: str, unresponsive_s: float):
        self.unresponsive_s = float(unresponsive_s)
        self.interval_s = min(5.0, self.unresponsive_s / 4)
        self.client = EnvClient(url, timeout_s=self.interval_s, retries=0)
        self.reset()

    def reset(self) -> None:
        self.answered = self.probed = time.monotonic()

    def silent_for(self) -> float | None:
        """Seconds without an answer once they reach ``unresponsive_s``, else None (probing when it is time)."""
        now = time.monotonic()
        if now - self.probed >= self.interval_s:
            self.probed = now
            try:
                self.client.health()
                self.answered = time.monotonic()
            except EnvServiceError as exc:
                if exc.status is not None:  # an HTTP answer
                    self.answered = time.monotonic()
        silent = time.monotonic() - self.answered
        return silent if silent >= self.unresponsive_s else None


def _terminate(proc: subprocess.Popen | None, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``grace_s`` (at once for 0: a stopped process would only queue the SIGTERM)."""
    if proc is None:
        return
    if grace_s:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, service_id: str, timeout_s: float = 120.0) -> None:
    """Wait until the service ``proc`` started answers at ``url`` as ``service_id``.

    A server that answers with another id is someone else's (the port was taken): never ours to use.
    """
    client = EnvClient(url, timeout_s=2, retries=0)
    deadline = time.monotonic() + timeout_s
    stranger = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            taken = (
                f"; port {url.rsplit(':', 1)[-1]} is taken by another server" if stranger else " (is the port in use?)"
            )
            raise ServiceStartError(
                f"the environment service exited with code {proc.returncode}{taken}: set env_service.port=null "
                f"(a free port) or free the port; the service log says more"
            )
        with contextlib.suppress(EnvServiceError):
            answered = client.health().get("service_id")
            if answered == service_id:
                return
            stranger = answered or "none"
        time.sleep(0.3)
    what = f"another server answers there (service id {stranger!r})" if stranger else "no answer"
    raise ServiceStartError(f"the environment service did not become healthy at {url} within {timeout_s:.0f}s: {what}")


# ---- one service per node ---------------------------------------------------------------------------------


class NodeService:
    """Ray actor owning one node's service (a loopback ``LocalService`` with the run's secret), supervised as the
    launcher supervises its own (``supervise``: ``LocalService.supervise``'s budget and silence limit)."""

    def __init__(self, secret: str, service_id: str, flags: list[str], supervise: dict | None = None):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self._dir = tempfile.mkdtemp(prefix="seal-env-")  # 0700: the secret file is private to this user
        self._secret = secret
        self.service = LocalService(
            write_secret(Path(self._dir) / "secret", secret),
            f"{service_id}:{self.node_id}",
            flags=flags,
            log_path=Path(self._dir) / "env_service.log",
        ).start()
        self.service.supervise(**(supervise or {}))

    def url(self) -> str:
        return self.service.url

    def gave_up(self) -> str | None:
        """Why supervision ended with this node's service down (None while it is supervised)."""
        return self.service.gave_up

    def secret(self) -> str:
        return self._secret

    def set_profile(self, profile: dict, run_id: str | None) -> dict:
        with make_client(self.service.url, run_id=run_id, secret=self._secret, retries=1) as client:
            return client.set_profile(profile)

    def stop(self) -> None:
        self.service.stop()
        with contextlib.suppress(OSError):
            (Path(self._dir) / "secret").unlink()


def start_node_services(
    secret: str, service_id: str, flags: list[str] = (), supervise: dict | None = None, timeout_s: float | None = None
) -> dict[str, str]:
    """One ``NodeService`` actor on every alive Ray node (Ray must be initialised); node id -> URL. ``timeout_s``
    (None: a service's start wait, its workers sized as on this node, plus :data:`ACTOR_START_S`) bounds
    the wait for them all.

    The actors belong to this process's Ray connection (they are not detached): they end with it, and their
    services with them (``--parent-pid``), when the launcher disconnects or dies; :func:`stop_node_services` stops
    them before that, cleanly. Ray also ends such an actor once no handle to it is left: this module keeps the
    handles until then.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_restarts=0)(NodeService)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    actors = {
        node_id: remote.options(
            name=actor_name(service_id, node_id),
            namespace=ACTOR_NAMESPACE,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(secret, service_id, list(flags), supervise)
        for node_id in nodes
    }
    try:
        wait_s = timeout_s or service_workers(_options(list(flags))).start_wait_s + ACTOR_START_S
        urls = ray.get([actor.url.remote() for actor in actors.values()], timeout=wait_s)
    except Exception as exc:
        stop_node_services(service_id, nodes)
        raise ServiceStartError(f"an environment service on a Ray node did not start: {exc}") from exc
    _HANDLES[service_id] = list(actors.values())
    return dict(zip(actors, urls))


#: The node service actors this process started, by service id (see ``start_node_services``).
_HANDLES: dict[str, list] = {}


def node_services_given_up(service_id: str, node_ids, timeout_s: float = 30.0) -> list[str]:
    """Why each node service of ``service_id`` whose supervision gave up did (Ray must be initialised); a node
    that does not answer in time is asked again next time."""
    import ray

    reasons = []
    for node_id in node_ids:
        with contextlib.suppress(Exception):
            actor = ray.get_actor(actor_name(service_id, node_id), namespace=ACTOR_NAMESPACE)
            why = ray.get(actor.gave_up.remote(), timeout=timeout_s)
            if why:
                reasons.append(f"on Ray node {node_id}: {why}")
    return reasons


def stop_node_services(service_id: str, node_ids) -> None:
    """Stop and remove the node services of ``service_id`` (Ray must be initialised); missing ones are skipped."""
    import ray

    for node_id in node_ids:
        with contextlib.suppress(Exception):
            actor = ray.get_actor(actor_name(service_id, node_id), namespace=ACTOR_NAMESPACE)
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=30)
            ray.kill(actor)
    _HANDLES.pop(service_id, None)


# ---- the run's service ----------------------------------------------------------------------------------


class RunStopped(RuntimeError):
    """A run that stopped for a cause its one-line message names."""


@contextlib.contextmanager
def environment_service(config: DictConfig):
    """The run's environment service; yields its URL and fills ``env_service.run_id``/``secret_file``/...

    ``env_service.url`` set: that service (it must answer /health); its secret, if any, comes from
    ``env_service.secret_file`` or ``$SEAL_ENV_SECRET``. Otherwise services started for this run only, with
    a fresh secret (a 0600 file in the run directory, never printed) and a fresh identity checked in
    /health: one on this machine's loopback, or one per Ray node when ``trainer.nnodes > 1``. Each is restarted
    when it dies and exits with its owner (``LocalService``); a run stopped for environment failures ends with
    ``RunStopped``, one line naming the service and its log (docs/faults.md).
    """
    from env_service.http.auth import resolve_secret

    env = config.env_service
    env.run_id = env.run_id or f"{config.trainer.experiment_name}-{new_service_id()}"
    if env.url:
        try:
            EnvClient(env.url, timeout_s=5, retries=1, secret=resolve_secret(secret_file=env.secret_file)).health()
        except Exception as exc:
            raise PreflightError(f"env_service.url {env.url!r} is not reachable: {exc}") from exc
        with _naming_the_service(lambda: f"the environment service at {env.url} (yours: its log is where you keep it)"):
            yield env.url
        return
    run_dir = Path(config.seal.run_dir).resolve()  # workers on any node read the secret file by this path
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = new_secret()
    env.secret_file = write_secret(run_dir / "env_service.secret", secret)
    env.service_id = new_service_id()
    try:
        from seal.launch.multinode import on_a_cluster

        starter = _node_services if on_a_cluster(config) else _local_service
        with starter(config, secret) as url:
            yield url
    except ServiceStartError as exc:
        raise PreflightError(str(exc)) from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(env.secret_file)


@contextlib.contextmanager
def _local_service(config: DictConfig, secret: str):
    from env_service.http.auth import SECRET_ENV

    env = config.env_service
    log_path = Path(config.seal.run_dir) / "env_service.log"
    service = LocalService(
        env.secret_file,
        env.service_id,
        port=env.port,
        flags=serve_flags(serve_options(config)),
        log_path=log_path,
        host=str(env.host),
    ).start()
    print(f"[seal] environment service up at {service.url} (pid {service.proc.pid}, log {log_path})")
    service.supervise(
        report=lambda line: print(f"[seal] {line}", flush=True),
        on_give_up=lambda why: _interrupt_main(),  # the run stops wherever it waits; service.gave_up says why
        **_supervision(env.supervise),
    )
    # The clients of this process and of the local Ray cluster it starts (which inherits the environment)
    # default to $SEAL_ENV_SECRET; env_service.secret_file also names it, for processes started elsewhere.
    previous = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = secret
    try:
        with _naming_the_service(service.describe):
            yield service.url
    except KeyboardInterrupt:
        if service.gave_up:
            raise RunStopped(service.gave_up) from None
        raise
    finally:
        service.stop()
        if previous is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = previous


def _interrupt_main() -> None:
    """Stop the launcher's main thread as Ctrl-C would (a real SIGINT wakes it from any wait: a sleep, Ray's get),
    so the run leaves through its ``finally`` blocks."""
    import signal

    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


@contextlib.contextmanager
def _node_services(config: DictConfig, secret: str):
    """One service per Ray node, each owned by an actor of this process's Ray connection, the run's driver: the
    launcher connects once, as verl's ``run_ppo`` would (``connect_ray``; run_ppo then uses that connection), so
    the actors end with the launcher however it ends (SIGKILL included: Ray ends a driver's actors with it, and
    each service exits with its actor). The launcher watches them; one whose restart budget is spent stops the run."""
    import ray

    env = config.env_service
    connect_ray(config)
    try:
        here = ray.get_runtime_context().get_node_id()
        env.nodes = start_node_services(
            secret, env.service_id, serve_flags(serve_options(config)), _supervision(env.supervise)
        )
        print(f"[seal] {len(env.nodes)} environment services up, one per node: {dict(env.nodes)}")
        services = f"the environment services {dict(env.nodes)} (each logs to env_service.log in a seal-env-* folder)"
        gave_up: list[str] = []
        watching = threading.Event()

        def watch():  # a service past its restart budget: the run stops, naming it
            while not watching.wait(WATCH_S):
                gave_up.extend(node_services_given_up(env.service_id, list(env.nodes)))
                if gave_up:
                    _interrupt_main()
                    return

        threading.Thread(target=watch, name="env-services-watch", daemon=True).start()
        try:
            with _naming_the_service(lambda: services):
                yield env.nodes.get(here) or next(iter(env.nodes.values()))
        except KeyboardInterrupt:
            if gave_up:
                raise RunStopped(gave_up[0]) from None
            raise
        finally:
            watching.set()
            stop_node_services(env.service_id, list(env.nodes))
    finally:
        ray.shutdown()


#: How often the launcher asks its node services whether one has given up.
WATCH_S = 5.0


def _supervision(supervise) -> dict:
    """``env_service.supervise`` as ``LocalService.supervise`` takes it."""
    return {"max_restarts": int(supervise.max_restarts), "unresponsive_s": float(supervise.unresponsive_s)}


@contextlib.contextmanager
def _naming_the_service(describe):
    """A run that stops for failed episodes (``TooManyFailedEpisodes``, raised in the trainer and delivered here
    wrapped in Ray's task error) says so in one line; when the environment failed them, naming the service
    (``describe()``) and its log (a generation or agent-loop failure has nothing to do with the service's log)."""
    try:
        yield
    except Exception as exc:
        from seal.failed_episodes import ENVIRONMENT, TooManyFailedEpisodes

        if not isinstance(exc, TooManyFailedEpisodes):
            raise
        cause = getattr(exc, "cause", None) or exc
        where = f"; {describe()}" if getattr(cause, "kind", ENVIRONMENT) == ENVIRONMENT else ""
        raise RunStopped(f"{cause}{where}") from None


__all__ = [
    "environment_service",
    "LocalService",
    "NodeService",
    "node_services_given_up",
    "ServiceStartError",
    "HealthProbe",
    "listen",
    "new_secret",
    "new_service_id",
    "peak_episodes",
    "RunStopped",
    "serve_flags",
    "serve_options",
    "start_node_services",
    "stop_node_services",
    "wait_healthy",
    "write_secret",
]
