"""How the run's processes find their environment services: the agent loop's service, the trainer's profile pushes.

The launcher (``seal.launch.service``) starts the services and writes where they are into
``config.env_service``: one ``url`` (and ``secret_file``), or with several nodes ``nodes`` (Ray node id -> URL),
each node's service owned by a Ray actor named :func:`actor_name` in :data:`ACTOR_NAMESPACE`. An agent-loop worker
uses its own node's service (:func:`service_for_this_node`); a failure profile goes to every one
(:func:`profile_client`).
"""

from __future__ import annotations

import functools
from typing import Any

from env_service.client import EnvServiceError, ProfileFanOut, make_client
from env_service.http.auth import resolve_secret

#: Ray namespace of the per-node service actors (named ``<service_id>:<node_id>``).
ACTOR_NAMESPACE = "seal-env-services"
#: Threads for the environment calls of one worker process's episodes. Each call blocks its thread for the HTTP round
#: trip, so the default executor (min(32, cores + 4) threads, 6 on a 2-core machine) would cap the episodes waiting
#: on the service at once below a worker's share of a step (validation: 400 / 8 workers = 50) and stall verl's own
#: tokenisation, which runs there too. Threads start only as calls need them.
ENV_CALL_THREADS = 256
_CLIENTS: dict[tuple, Any] = {}


class NoServiceOnThisNode(RuntimeError):
    """A process runs on a Ray node that has no environment service of the run."""


def actor_name(service_id: str, node_id: str) -> str:
    return f"{service_id}:{node_id}"


def _node_actor(env, node_id: str):
    import ray

    return ray.get_actor(actor_name(env.service_id, node_id), namespace=ACTOR_NAMESPACE)


def service_for_this_node(env) -> tuple[str, str | None]:
    """``(url, secret)`` of the environment service an agent-loop worker uses (``env``: ``config.env_service``).

    With ``env.nodes`` (several nodes): the service of the node this process runs on; else ``env.url``
    with the secret from ``env.secret_file`` or ``$SEAL_ENV_SECRET``. Resolved once per process.
    """
    nodes = env.get("nodes")
    return _resolve(env.url, env.get("secret_file"), env.get("service_id"), tuple(sorted(dict(nodes or {}).items())))


@functools.lru_cache(maxsize=8)
def _resolve(url, secret_file, service_id, nodes: tuple) -> tuple[str, str | None]:
    if not nodes:
        return url, resolve_secret(secret_file=secret_file)
    import ray

    node_id, urls = ray.get_runtime_context().get_node_id(), dict(nodes)
    if node_id not in urls:
        raise NoServiceOnThisNode(
            f"no environment service runs on Ray node {node_id} (services: {sorted(urls)}); "
            "a node joined after the launcher started the services"
        )
    actor = ray.get_actor(actor_name(service_id, node_id), namespace=ACTOR_NAMESPACE)
    return urls[node_id], ray.get(actor.secret.remote())


class _NodeProfileClient:
    """``set_profile`` through a node's actor (the services listen on their own node's loopback only)."""

    def __init__(self, actor, run_id: str | None):
        self.actor, self.run_id = actor, run_id

    def set_profile(self, profile: dict) -> dict:
        import ray

        try:
            return ray.get(self.actor.set_profile.remote(profile, self.run_id))
        except Exception as exc:  # a Ray error wrapping whatever the node raised
            raise EnvServiceError(None, f"pushing the profile through {self.actor}: {exc}", "node_error") from exc

    def close(self) -> None:
        pass


def profile_client(env, run_id: str | None, **http_options):
    """Where the trainer pushes failure profiles: every node's service, or the one service."""
    nodes = env.get("nodes")
    if not nodes:
        url, secret = service_for_this_node(env)
        return make_client(url, run_id=run_id, secret=secret, **http_options)
    return ProfileFanOut([_NodeProfileClient(_node_actor(env, node_id), run_id) for node_id in nodes])


def env_client(env_cfg):
    """One client per process and service (``config.env_service``), for the agent loop's episodes and the trainer:
    keeps the connection pool warm.

    The service is this node's when the launcher started one per node; the client names the run (failure
    profiles are per run) and carries the run's secret.
    """
    url, secret = service_for_this_node(env_cfg)
    key = (url, float(env_cfg.timeout_s), int(env_cfg.retries), env_cfg.get("run_id"))
    if key not in _CLIENTS:
        _CLIENTS[key] = make_client(
            url,
            run_id=env_cfg.get("run_id"),
            secret=secret,
            timeout_s=float(env_cfg.timeout_s),
            retries=int(env_cfg.retries),
            pool_size=ENV_CALL_THREADS,  # a connection for every env-call thread: none waits for a pooled one
        )
    return _CLIENTS[key]
