"""What a run on a Ray cluster (:func:`on_a_cluster`: several nodes, or a cluster started with ``ray start``) needs
from its nodes, made true or checked before it starts.

Ray ships the composed config to workers on every node, not the launcher's working directory: a relative path
resolves against each worker's own. So the launcher makes every path a worker reads or writes absolute
(:func:`absolute_paths`, on the head node, before the config leaves it), and preflight asks every Ray node
(:func:`cluster_problems`) whether it sees

* the same repository (``seal`` imported from the same directory) and the same venv (``sys.prefix``);
* the data files and a local model directory at the same absolute paths;
* ``trainer.default_local_dir`` and ``seal.run_dir`` as one shared filesystem: every rank writes its checkpoint
  shards to the first, and the trainer, on whichever node Ray places it, merges, prunes and exports checkpoints
  there and writes the run's metrics and tables to the second. A marker file the launcher writes into each must be
  readable on every node;
* a GPU trainer's devices on the nodes that hold its ranks (those with a GPU: :func:`trainer_nodes`), each with
  ``trainer.n_gpus_per_node`` CUDA devices and a driver that runs torch's CUDA: the launcher's own node may have
  none (a CPU head node is a common layout), so these are checked there and not on it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

#: Paths some worker reads or writes, on any node: made absolute against the launcher's working directory.
WORKER_PATHS = (
    "data.train_files",
    "data.val_files",
    "trainer.default_local_dir",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "seal.run_dir",
    "seal.diagnosis.state_dir",
    "seal.diagnosis.dump_dir",
    "seal.eval.results_path",
    "env_service.secret_file",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",
)
#: Paths that may also be hub ids: made absolute only when they name something here.
LOCAL_IF_PRESENT = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path")
#: Directories every node must see as one filesystem.
SHARED_DIRS = ("trainer.default_local_dir", "seal.run_dir")
MARKER_PREFIX = ".seal-shared-"
PROBE_TIMEOUT_S = 120
#: The Ray resource a trainer's ranks need, by ``trainer.device`` (a CPU trainer places its ranks anywhere).
DEVICE_RESOURCES = {"cuda": "GPU", "npu": "NPU"}


def on_a_cluster(config: DictConfig) -> bool:
    """Whether the run uses a Ray cluster started elsewhere (``trainer.nnodes > 1``, or
    ``ray_kwargs.ray_init.address``): its trainer's devices, and so its services, are on the cluster's nodes, which
    need not include this one."""
    return int(config.trainer.nnodes) > 1 or bool(config.ray_kwargs.ray_init.get("address"))


def absolute_paths(config: DictConfig) -> None:
    """Rewrite the relative paths of :data:`WORKER_PATHS` (and local ones of :data:`LOCAL_IF_PRESENT`) in place."""
    for key in WORKER_PATHS + LOCAL_IF_PRESENT:
        value = OmegaConf.select(config, key)
        if value is None:
            continue
        if isinstance(value, ListConfig):
            OmegaConf.update(config, key, [_absolute(str(v)) for v in value])
        elif key in WORKER_PATHS or Path(str(value)).exists():
            OmegaConf.update(config, key, _absolute(str(value)))


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)  # hdfs://... and the like are the same everywhere


def node_view(paths: list[str], markers: dict[str, list[str]], cuda: bool = False) -> dict:
    """What the node this runs on sees: where ``seal`` and Python come from, which of ``paths`` are missing, and
    which directories of ``markers`` (directory -> [marker file, token]) do not show the launcher's marker; with
    ``cuda`` (a node of a GPU trainer's ranks), its CUDA devices and what keeps CUDA from running there.
    A plain function: Ray runs it on every node, tests call it directly."""
    import seal

    view = {
        "host": socket.gethostname(),
        "repository": str(Path(seal.__file__).resolve().parents[1]),
        "venv": sys.prefix,
        "missing": [path for path in paths if not os.path.exists(path)],
        "unshared": [directory for directory, (marker, token) in markers.items() if _read(marker) != token],
    }
    if cuda:
        import torch

        from seal.launch.node_checks import cuda_problem, probe_cuda

        view["cuda_problem"] = cuda_problem(**probe_cuda())
        view["cuda_devices"] = torch.cuda.device_count() if view["cuda_problem"] is None else 0
    return view


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def view_problems(node: str, view: dict, launcher: dict, gpus_per_node: int = 0) -> list[str]:
    """One line per way ``node`` (its :func:`node_view`) differs from the launcher's, and, on a node of a GPU trainer
    (a view with ``cuda_problem``), what keeps it from giving the trainer ``gpus_per_node`` CUDA devices."""
    problems = []
    if view.get("cuda_problem"):
        problems.append(f"Ray node {node}: {view['cuda_problem']}")
    elif "cuda_devices" in view and view["cuda_devices"] < gpus_per_node:
        problems.append(
            f"Ray node {node} holds trainer ranks but {view['cuda_devices']} CUDA device(s) are visible there "
            f"(trainer.n_gpus_per_node={gpus_per_node})"
        )
    if view["repository"] != launcher["repository"]:
        problems.append(
            f"Ray node {node} imports seal from {view['repository']}, the launcher from {launcher['repository']}: "
            "check the repository out at the same absolute path on every node"
        )
    if view["venv"] != launcher["venv"]:
        problems.append(
            f"Ray node {node} runs Python from {view['venv']}, the launcher from {launcher['venv']}: create the venv "
            "at the same absolute path on every node and run `ray start` from it"
        )
    if view["missing"]:
        problems.append(
            f"Ray node {node} does not see {', '.join(view['missing'])}: put the data (and a local model) at the same "
            "absolute paths on every node, or on a shared filesystem"
        )
    for directory in view["unshared"]:
        problems.append(
            f"{directory} is not one filesystem shared by all nodes (a marker the launcher wrote there is not "
            f"visible on Ray node {node}): every rank writes checkpoint shards to trainer.default_local_dir and the "
            "trainer writes checkpoints, metrics and tables under it and seal.run_dir from whichever node it runs "
            "on; point both at a shared mount (e.g. NFS)"
        )
    return problems


def cluster_problems(config: DictConfig) -> list[str]:
    """Run :func:`node_view` on every alive node of the Ray cluster (``ray_kwargs.ray_init.address``, default
    ``auto``) and name every difference from the launcher's own view, and a cluster smaller than
    ``trainer.nnodes`` (nodes with the trainer's device: :func:`trainer_nodes`). Connects to Ray unless this process
    already is."""
    import ray

    owns = not ray.is_initialized()
    if owns:
        address = config.ray_kwargs.ray_init.get("address") or "auto"
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 - no cluster there: say so and how to start one
            return [
                f"trainer.nnodes={config.trainer.nnodes} needs a running Ray cluster (`ray start --head` on this node, "
                f"`ray start --address=HEAD:6379` on the others); connecting to {address!r} failed: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ]
    try:
        with _markers(config) as markers:
            return _ask_nodes(config, markers)
    finally:
        if owns:
            ray.shutdown()


def _ask_nodes(config: DictConfig, markers: dict[str, list[str]]) -> list[str]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [node for node in ray.nodes() if node["Alive"]]
    problems = []
    trainers = trainer_nodes(nodes, str(config.trainer.device))
    if len(trainers) < int(config.trainer.nnodes):
        kind = "" if str(config.trainer.device) == "cpu" else f" {DEVICE_RESOURCES[str(config.trainer.device)]}"
        problems.append(
            f"trainer.nnodes={config.trainer.nnodes} but the Ray cluster has {len(trainers)} alive{kind} node(s): "
            "start the others with `ray start --address=HEAD:6379` first"
        )
    paths = [path for path in _read_paths(config) if os.path.exists(path)]  # a missing one is preflight's business
    launcher = node_view(paths, {})
    probe = ray.remote(num_cpus=0, max_retries=0)(node_view)
    gpu_trainer = str(config.trainer.device) == "cuda"
    ranks = {node["NodeID"] for node in trainers}
    pending = {
        f"{node['NodeManagerAddress']} ({node['NodeID'][:8]})": probe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(paths, markers, cuda=gpu_trainer and node["NodeID"] in ranks)
        for node in nodes
    }
    for name, ref in pending.items():
        try:
            view = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - e.g. `seal` not importable there: its venv is another one
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            problems.append(
                f"Ray node {name} could not run the node check ({reason}): it needs this repository and venv at "
                f"{launcher['repository']} and {launcher['venv']}"
            )
            continue
        problems += view_problems(name, view, launcher, int(config.trainer.n_gpus_per_node))
    return problems


def trainer_nodes(nodes: list[dict], device: str) -> list[dict]:
    """The alive Ray nodes (``ray.nodes()`` entries) a trainer of ``device`` can place ranks on: with GPUs, those
    that have one (a GPU-less head node is no node of ``trainer.nnodes``); on CPU, every node."""
    resource = DEVICE_RESOURCES.get(device)
    return [n for n in nodes if n["Alive"] and (resource is None or n.get("Resources", {}).get(resource, 0) > 0)]


def _read_paths(config: DictConfig) -> list[str]:
    """The data files and a local model: what workers read besides the repository and venv (compared apart)."""
    paths = []
    for key in ("data.train_files", "data.val_files") + LOCAL_IF_PRESENT:
        value = OmegaConf.select(config, key)
        if value is not None:
            paths += [str(v) for v in value] if isinstance(value, ListConfig) else [str(value)]
    return paths


@contextlib.contextmanager
def _markers(config: DictConfig):
    """A fresh marker file in each of :data:`SHARED_DIRS` (created if need be), removed afterwards."""
    markers = {}
    try:
        for key in SHARED_DIRS:
            directory = Path(str(OmegaConf.select(config, key)))
            directory.mkdir(parents=True, exist_ok=True)
            token = secrets.token_hex(16)
            marker = directory / f"{MARKER_PREFIX}{token}"
            marker.write_text(token)
            markers[f"{key} {directory}"] = [str(marker), token]
        yield markers
    finally:
        for marker, _ in markers.values():
            with contextlib.suppress(OSError):
                os.unlink(marker)
