"""The run's environment services: started, recognised and stopped here; found by the agent loop.

One node: the launcher starts one ``python -m env_service serve`` on 127.0.0.1 (a free port unless
``env_service.port`` names one). Several nodes (``trainer.nnodes > 1``): one service per node, each on
its own node's loopback and owned by a Ray actor pinned to that node; ``env_service.nodes`` maps Ray
node id -> URL; how the run's workers find them is :mod:`seal.env_clients`.

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

from env_service.client import EnvClient, EnvServiceError, make_client
from seal.env_clients import ACTOR_NAMESPACE, actor_name

REPO_ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


class ServiceStartError(RuntimeError):
    """A service of the run did not come up (or another server answered in its place)."""


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def new_service_id() -> str:
    return secrets.token_hex(8)


def write_secret(path: str | os.PathLike, secret: str) -> str:
    """Write ``secret`` to ``path``, readable by its owner only (created 0600, never world-readable)."""
    path = str(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)  # an existing file keeps its old mode through O_CREAT
        handle.write(secret)
    return path


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_flags(options) -> list[str]:
    """``env_service.serve`` (``{workers: 2, read_timeout_s: 10, ...}``) as ``serve`` flags; nulls are left out."""
    flags = []
    for key, value in dict(options or {}).items():
        if value is not None:
            flags += ["--" + str(key).replace("_", "-"), str(value)]
    return flags


# ---- what the run asks of its services -------------------------------------------------------------------


def serve_options(config) -> dict:
    """``env_service.serve`` of the recipe, with ``peak_episodes`` the recipe's (:func:`peak_episodes`) when null: the
    service then holds the trainer's concurrency (``HttpLimits.serving``)."""
    from omegaconf import OmegaConf

    options = dict(OmegaConf.to_container(config.env_service.serve, resolve=True) or {})
    if options.get("peak_episodes") is None:
        options["peak_episodes"] = peak_episodes(config)
    return options


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
    rows = _rows(config.data.val_files)
    batch = int(config.data.val_batch_size) if config.data.get("val_batch_size") else rows
    batch = min(batch, rows) if rows else batch
    workers = max(int(rollout.agent.num_workers), 1)
    padded = -(-batch // workers) * workers
    return max(train, padded * int(rollout.val_kwargs.n))


def _rows(files) -> int:
    """Rows of the parquet files (0 for a file that is not there: preflight names it)."""
    import pyarrow.parquet as pq

    paths = [files] if isinstance(files, str) else list(files or [])
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += pq.ParquetFile(str(path)).metadata.num_rows
    return total


class LocalService:
    """A ``python -m env_service serve`` process of this run, on this machine's loopback.

    It exits with the process that started it (``--parent-pid``: a killed launcher leaves no service behind), and
    :meth:`supervise` restarts it when it dies: same port, secret and identity, so the run's clients reconnect to it;
    the episodes it held fail (the run counts them as environment failures).
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
        self.host, self.port = host, int(port) if port else free_port(host)
        self.secret_file, self.service_id = secret_file, service_id
        self.flags, self.log_path = list(flags), log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._lock = threading.Lock()  # the process is replaced by the supervisor and stopped by the owner
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> str:
        log = f", log {self.log_path}" if self.log_path else ""
        return f"the environment service at {self.url} (pid {self.proc.pid if self.proc else '-'}{log})"

    def start(self, timeout_s: float = 120.0) -> LocalService:
        proc = self._spawn()
        try:
            wait_healthy(self.url, proc, self.service_id, timeout_s)
        except BaseException:
            _terminate(proc)
            raise
        return self

    def _spawn(self) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "env_service",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
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
                self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()
            return self.proc

    def supervise(self, report=print, poll_s: float = 1.0) -> LocalService:
        """Restart the service whenever it exits, until :meth:`stop`; ``report`` gets one line per event."""
        self._supervisor = threading.Thread(
            target=self._supervise, args=(report, poll_s), name="env-service-supervisor", daemon=True
        )
        self._supervisor.start()
        return self

    def _supervise(self, report, poll_s: float) -> None:
        while not self._stopping.wait(poll_s):
            code = self.proc.poll()
            if code is None or self._stopping.is_set():
                continue
            report(f"{self.describe()} exited with code {code}; restarting it (its episodes in flight fail)")
            try:
                self.start()
            except (ServiceStartError, OSError) as exc:
                if not self._stopping.is_set():
                    report(f"could not restart the environment service: {exc}; episodes will fail until the run stops")
                return
            self.restarts += 1
            report(f"{self.describe()} restarted ({self.restarts} restart(s) in this run)")

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:  # no new process after this: a restart in progress fails at its next health check
            proc = self.proc
        _terminate(proc)
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join()


def _terminate(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
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
    """Ray actor owning one node's service (a loopback ``LocalService`` with the run's secret)."""

    def __init__(self, secret: str, service_id: str, flags: list[str]):
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
        self.service.supervise()

    def url(self) -> str:
        return self.service.url

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
    secret: str, service_id: str, flags: list[str] = (), timeout_s: float = 300.0
) -> dict[str, str]:
    """One ``NodeService`` actor on every alive Ray node (Ray must be initialised); node id -> URL.

    The actors are detached: they outlive this driver's connection (the launcher disconnects before
    verl connects again), so stop them with :func:`stop_node_services`.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_restarts=0)(NodeService)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    actors = {
        node_id: remote.options(
            name=actor_name(service_id, node_id),
            namespace=ACTOR_NAMESPACE,
            lifetime="detached",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(secret, service_id, list(flags))
        for node_id in nodes
    }
    try:
        urls = ray.get([actor.url.remote() for actor in actors.values()], timeout=timeout_s)
    except Exception as exc:
        stop_node_services(service_id, nodes)
        raise ServiceStartError(f"an environment service on a Ray node did not start: {exc}") from exc
    return dict(zip(actors, urls))


def stop_node_services(service_id: str, node_ids) -> None:
    """Stop and remove the node services of ``service_id`` (Ray must be initialised); missing ones are skipped."""
    import ray

    for node_id in node_ids:
        with contextlib.suppress(Exception):
            actor = ray.get_actor(actor_name(service_id, node_id), namespace=ACTOR_NAMESPACE)
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(), timeout=30)
            ray.kill(actor)


__all__ = [
    "LocalService",
    "NodeService",
    "ServiceStartError",
    "free_port",
    "new_secret",
    "new_service_id",
    "peak_episodes",
    "serve_flags",
    "serve_options",
    "start_node_services",
    "stop_node_services",
    "wait_healthy",
    "write_secret",
]
