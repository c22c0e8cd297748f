"""What a multi-node run needs from its nodes (``seal/launch/multinode.py``): absolute paths in the config that leaves the
head node, and a preflight through Ray that every node sees the same repository, venv and data and one shared
checkpoint filesystem. Another node is played by the per-node function with that node's view of the filesystem
(a different directory); the check itself runs through a real local Ray cluster."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from seal.launch import multinode
from seal.launch.preflight import _check_cluster
from seal.launch.recipe import compose_recipe, prepare
from seal.launch.service import environment_service

ROOT = Path(__file__).resolve().parents[2]
GPU_SMOKE = str(ROOT / "exp" / "gpu_smoke.yaml")


def _recipe(tmp_path, *overrides):
    return compose_recipe(
        GPU_SMOKE,
        [
            f"seal.run_dir={tmp_path}/run",
            f"trainer.default_local_dir={tmp_path}/checkpoints",
            f"data.train_files={ROOT}/data/bfcl_train.parquet",
            f"data.val_files={ROOT}/data/bfcl_heldout.parquet",
            *overrides,
        ],
    )


def test_every_path_a_worker_reads_becomes_absolute_against_the_launch_directory(tmp_path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    config = compose_recipe(
        GPU_SMOKE,
        [
            "data.train_files=[data/a.parquet,hdfs://namenode/b.parquet]",
            "data.val_files=data/heldout.parquet",
            "env_service.secret_file=secrets/env.secret",
            "actor_rollout_ref.model.path=models/mine",
            "seal.diagnosis.dump_dir=stats",
        ],
    )
    multinode.absolute_paths(config)
    assert list(config.data.train_files) == [f"{tmp_path}/data/a.parquet", "hdfs://namenode/b.parquet"]
    assert config.data.val_files == f"{tmp_path}/data/heldout.parquet"
    assert config.env_service.secret_file == f"{tmp_path}/secrets/env.secret"
    assert config.actor_rollout_ref.model.path == f"{tmp_path}/models/mine"
    # the recipe's defaults: checkpoints/<project>/<experiment> and experiments/<experiment>, with what follows them
    assert config.trainer.default_local_dir == f"{tmp_path}/checkpoints/SEAL/gpu_smoke"
    assert config.seal.run_dir == f"{tmp_path}/experiments/gpu_smoke"
    assert config.trainer.rollout_data_dir == f"{tmp_path}/experiments/gpu_smoke/rollout_log"
    assert config.seal.diagnosis.state_dir == f"{tmp_path}/experiments/gpu_smoke/diagnostic_state"
    assert config.seal.diagnosis.dump_dir == f"{tmp_path}/stats"

    hub = compose_recipe(GPU_SMOKE)
    multinode.absolute_paths(hub)
    assert hub.actor_rollout_ref.model.path == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id stays one


def test_the_launcher_ships_absolute_paths(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = prepare(compose_recipe(GPU_SMOKE))
    assert os.path.isabs(config.data.train_files) and os.path.isabs(config.trainer.default_local_dir)
    assert config.trainer.default_local_dir == f"{ROOT}/checkpoints/SEAL/gpu_smoke"


def test_a_node_on_another_filesystem_is_named(tmp_path):
    config = _recipe(tmp_path)
    data = [config.data.train_files, config.data.val_files]
    elsewhere = tmp_path / "other-node-mount"  # what another node finds at the same paths: not the launcher's files
    elsewhere.mkdir()
    with multinode._markers(config) as markers:
        launcher = multinode.node_view(data, markers)
        assert launcher["unshared"] == [] and launcher["missing"] == []
        assert launcher["repository"] == str(ROOT) and launcher["venv"] == sys.prefix
        there = {
            directory: [str(elsewhere / Path(marker).name), token] for directory, (marker, token) in markers.items()
        }
        other = multinode.node_view([*data, str(elsewhere / "bfcl_heldout.parquet")], there)
    assert not any(p.name.startswith(multinode.MARKER_PREFIX) for p in tmp_path.rglob("*"))  # markers cleaned up

    problems = multinode.view_problems("10.0.0.2 (0123abcd)", other, launcher)
    [missing, checkpoints, run_dir] = problems
    assert "Ray node 10.0.0.2 (0123abcd) does not see" in missing and "other-node-mount/bfcl_heldout" in missing
    assert checkpoints.startswith(f"trainer.default_local_dir {tmp_path}/checkpoints is not one filesystem shared")
    assert "visible on Ray node 10.0.0.2 (0123abcd)" in checkpoints and "shared mount" in checkpoints
    assert run_dir.startswith(f"seal.run_dir {tmp_path}/run is not one filesystem shared")


def test_another_repository_or_venv_is_named():
    launcher = {"repository": "/srv/seal", "venv": "/srv/seal/.venv", "missing": [], "unshared": []}
    other = {**launcher, "repository": "/home/me/seal", "venv": "/opt/conda"}
    [repository, venv] = multinode.view_problems("node-b", other, launcher)
    assert "imports seal from /home/me/seal, the launcher from /srv/seal" in repository
    assert "same absolute path on every node" in repository
    assert "runs Python from /opt/conda, the launcher from /srv/seal/.venv" in venv and "ray start" in venv
    assert multinode.view_problems("node-b", dict(launcher), launcher) == []


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    # one logical GPU: the GPU recipe's node (a node without one is no node of trainer.nnodes for a GPU trainer)
    ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_the_check_runs_on_every_ray_node_and_refuses_a_short_cluster(local_ray, tmp_path):
    import torch

    config = _recipe(tmp_path)
    # one node: the launcher's own, which sees everything; it holds the GPU trainer's ranks, so its CUDA is checked
    # (this machine's torch is a CPU build)
    [cuda] = multinode.cluster_problems(config)
    assert cuda.startswith("Ray node ") and f"torch {torch.__version__} is a CPU build" in cuda
    assert (tmp_path / "checkpoints").is_dir() and not list((tmp_path / "checkpoints").iterdir())  # marker removed

    OmegaConf.update(config, "trainer.nnodes", 2)
    problems = []
    _check_cluster(config, problems)
    assert problems == [
        "trainer.nnodes=2 but the Ray cluster has 1 alive GPU node(s): start the others with `ray start "
        "--address=HEAD:6379` first",
        cuda,
    ]


def test_the_runs_secret_file_is_named_by_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = compose_recipe(str(ROOT / "exp" / "cpu_tiny.yaml"), ["seal.run_dir=run", "env_service.serve.workers=0"])
    with environment_service(config):
        assert config.env_service.secret_file == f"{tmp_path}/run/env_service.secret"


def test_a_gpu_less_head_node_is_not_a_node_of_nnodes():
    """``ray.nodes()`` entries (the fields the count reads): a CPU-only head and two GPU workers make 2 nodes for a
    CUDA trainer; a dead GPU node counts for nothing; a CPU trainer places ranks on every alive node."""
    head = {"NodeID": "h", "Alive": True, "Resources": {"CPU": 16.0, "memory": 1e9}}
    workers = [{"NodeID": f"w{i}", "Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}} for i in range(2)]
    dead = {"NodeID": "d", "Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}
    nodes = [head, *workers, dead]
    assert multinode.trainer_nodes(nodes, "cuda") == workers
    assert multinode.trainer_nodes(nodes, "cpu") == [head, *workers]


def test_a_node_holding_trainer_ranks_without_their_devices_is_named():
    launcher = {"repository": "/srv/seal", "venv": "/srv/seal/.venv", "missing": [], "unshared": []}
    node = {**launcher, "cuda_problem": None, "cuda_devices": 2}
    assert multinode.view_problems("node-b", node, launcher, gpus_per_node=4) == [
        "Ray node node-b holds trainer ranks but 2 CUDA device(s) are visible there (trainer.n_gpus_per_node=4)"
    ]
    assert multinode.view_problems("node-b", {**node, "cuda_devices": 4}, launcher, gpus_per_node=4) == []
    assert multinode.view_problems("node-b", dict(launcher), launcher, gpus_per_node=4) == []  # holds no ranks
