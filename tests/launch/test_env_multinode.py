"""Several nodes on one machine (two Ray nodes: a head without GPUs, as a CPU head node is, and a node with a
GPU-like resource): one environment service per node, owned by an actor on that node; each worker uses its own
node's service; a failure profile reaches every service; the preflight node check passes on both and asks a GPU
trainer's CUDA of the GPU node only; a killed launcher leaves no service behind on either node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from omegaconf import OmegaConf

from env_service.client import EnvClient, make_client
from seal import env_clients
from seal.launch import service
from tests.support.processes import processes, wait_for

CUE_PROFILE = {"tags": {"missing_tool_call": {"count": 40, "reward_mean": 0.1}}}
CUE_PARAMS = {"capability_cues": {"enable": True}}
RUN = "multinode-run"


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    cluster.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=cluster.address, namespace=env_clients.ACTOR_NAMESPACE, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def _on_node(ray, node_id: str, env_cfg: dict):
    """What an agent-loop worker placed on ``node_id`` does: resolve its service, run an episode there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def worker(env_cfg):
        from omegaconf import OmegaConf

        from env_service.client import make_client
        from seal.env_clients import service_for_this_node

        url, secret = service_for_this_node(OmegaConf.create(env_cfg))
        with make_client(url, run_id=RUN, secret=secret, retries=0) as client:
            created = client.create("multi_turn_base_0", "train", CUE_PARAMS)
            client.release(created["instance_id"])
            return url, client.health()["service_id"], created["messages"][0]["content"]

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.get(worker.options(scheduling_strategy=strategy).remote(env_cfg), timeout=120)


@pytest.mark.slow
def test_one_service_per_node_used_by_that_nodes_workers_and_profiles_reach_all_and_a_spent_budget_is_named(cluster):
    ray = cluster
    secret, service_id = service.new_secret(), service.new_service_id()
    budget = {"max_restarts": 0, "unresponsive_s": 60}
    nodes = service.start_node_services(secret, service_id, ["--workers", "0"], budget)
    try:
        assert len(nodes) == 2 and len(set(nodes.values())) == 2
        env = OmegaConf.create({"url": None, "secret_file": None, "service_id": service_id, "nodes": nodes})
        for url in nodes.values():  # each listens on loopback and wants the secret
            assert url.startswith("http://127.0.0.1:")
            assert requests.get(url + "/profile", timeout=10).status_code == 401

        env_clients.profile_client(env, RUN).set_profile(CUE_PROFILE)

        for node_id, url in nodes.items():
            used, answered_as, system_prompt = _on_node(ray, node_id, OmegaConf.to_container(env))
            assert used == url and answered_as == f"{service_id}:{node_id}"  # its own node's service
            assert "# Behavioral guidelines" in system_prompt  # the pushed profile reached this service
            assert EnvClient(url, secret=secret, run_id=RUN).get_profile()["profile"] == CUE_PROFILE
            assert make_client(url, secret=secret, run_id="another-run").get_profile()["profile"] is None

        # each node's actor supervises its service as the launcher does; past its budget it says so, which the
        # launcher polls (node_services_given_up) to stop the run naming the node
        assert service.node_services_given_up(service_id, list(nodes)) == []
        node_id = next(iter(nodes))
        [pid] = [pid for pid, p in processes().items() if f"--service-id {service_id}:{node_id}" in p["cmd"]]
        os.kill(pid, signal.SIGKILL)
        [why] = wait_for(lambda: service.node_services_given_up(service_id, list(nodes)), 30, "no give-up")
        assert why.startswith(f"on Ray node {node_id}: the environment service at {nodes[node_id]} (pid {pid}")
        assert why.endswith(
            "exited with code -9 after 0 restart(s), the most env_service.supervise.max_restarts allows: the run stops"
        )
    finally:
        service.stop_node_services(service_id, list(nodes))
    for url in nodes.values():
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=5)


@pytest.mark.slow
def test_both_nodes_pass_the_node_check(cluster, tmp_path, monkeypatch):
    """Two Ray nodes on one machine share its filesystem, repository and venv: the check runs on each and finds
    nothing; a third node asked for is refused."""
    from pathlib import Path

    from seal.launch import multinode
    from seal.launch.recipe import compose_recipe

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    config = compose_recipe(
        "exp/cpu_tiny.yaml",
        [f"seal.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/checkpoints", "trainer.nnodes=2"],
    )
    multinode.absolute_paths(config)
    assert multinode.cluster_problems(config) == []
    config.trainer.nnodes = 3
    assert multinode.cluster_problems(config) == [
        "trainer.nnodes=3 but the Ray cluster has 2 alive node(s): start the others with `ray start --address=HEAD:6379` "
        "first"
    ]


@pytest.mark.slow
def test_the_launcher_runs_one_service_per_node(cluster, tmp_path):
    from pathlib import Path

    from seal.launch.recipe import compose_recipe
    from seal.launch.service import environment_service

    ray = cluster
    address = ray.get_runtime_context().gcs_address
    ray.shutdown()  # the launcher connects (and disconnects) itself
    config = compose_recipe(
        str(Path(__file__).resolve().parents[2] / "exp" / "cpu_tiny.yaml"),
        [
            f"seal.run_dir={tmp_path}",
            "trainer.nnodes=2",
            "env_service.serve.workers=0",
            f"+ray_kwargs.ray_init.address={address}",
        ],
    )
    try:
        with environment_service(config) as url:
            nodes = dict(config.env_service.nodes)
            assert len(nodes) == 2 and url in nodes.values()
            secret = Path(config.env_service.secret_file).read_text()
            for node_url in nodes.values():
                assert (
                    EnvClient(node_url, secret=secret, retries=0)
                    .health()["service_id"]
                    .startswith(config.env_service.service_id)
                )
        assert not ray.is_initialized()
        for node_url in nodes.values():  # stopped with the run
            with pytest.raises(requests.ConnectionError):
                requests.get(node_url + "/health", timeout=5)
    finally:
        ray.init(address=address, namespace=env_clients.ACTOR_NAMESPACE, log_to_driver=False)


ROOT = Path(__file__).resolve().parents[2]

KILLED_LAUNCHER = """
import sys, time
from seal.launch.recipe import compose_recipe
from seal.launch.service import environment_service

overrides = ["trainer.nnodes=2", "env_service.serve.workers=0", "+ray_kwargs.ray_init.address=" + sys.argv[2]]
config = compose_recipe("exp/cpu_tiny.yaml", ["seal.run_dir=" + sys.argv[1], *overrides])
with environment_service(config):
    print("service id", config.env_service.service_id, flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_service_or_actor_on_any_node(cluster, tmp_path):
    """The launcher (the run's Ray driver) is SIGKILLed with a service up on each node: within a bounded time Ray has
    ended its actors and each service has exited with its actor, on both nodes."""
    ray = cluster
    launcher = subprocess.Popen(
        [sys.executable, "-c", KILLED_LAUNCHER, str(tmp_path), ray.get_runtime_context().gcs_address],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        up = next((line for line in iter(launcher.stdout.readline, "") if line.startswith("service id ")), None)
        assert up, "the launcher exited before its services were up"
        service_id = up.split()[-1]

        def of_the_run():
            actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if service_id in a["name"]]
            services = [pid for pid, p in processes().items() if f"--service-id {service_id}:" in p["cmd"]]
            return actors, [pid for pid in services if processes().get(pid, {}).get("state") != "Z"]

        actors, services = of_the_run()
        assert len(actors) == 2 and len(services) == 2, (actors, services)
        launcher.kill()
        launcher.wait(30)
        killed = time.monotonic()
        wait_for(lambda: of_the_run() == ([], []), 60, "an actor or a service of the killed launcher still runs")
        print(f"nothing of the run left {time.monotonic() - killed:.1f} s after the launcher's SIGKILL")
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow
def test_a_gpu_less_head_node_is_accepted_and_the_gpu_node_checked(cluster, tmp_path):
    """A GPU recipe launched from the head, which has no GPU: the launcher's node is not asked for CUDA devices; the
    node that holds the trainer's ranks is (here it has a GPU resource but this machine's CPU-only torch, which the
    check names, with that node)."""
    import torch

    from seal.launch import multinode
    from seal.launch.preflight import _check_device
    from seal.launch.recipe import compose_recipe

    ray = cluster
    config = compose_recipe(
        str(ROOT / "exp" / "gpu_smoke.yaml"),
        [
            f"seal.run_dir={tmp_path}/run",
            f"trainer.default_local_dir={tmp_path}/checkpoints",
            f"data.train_files={ROOT}/data/bfcl_train.parquet",
            f"data.val_files={ROOT}/data/bfcl_heldout.parquet",
            f"+ray_kwargs.ray_init.address={ray.get_runtime_context().gcs_address}",
        ],
    )
    problems = []
    _check_device(config, problems)
    assert problems == []
    [gpu_node] = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]
    assert multinode.cluster_problems(config) == [
        f"Ray node {gpu_node['NodeManagerAddress']} ({gpu_node['NodeID'][:8]}): torch {torch.__version__} is a CPU "
        "build but the recipe trains on CUDA: install the GPU stack into this environment (`bash scripts/install.sh "
        "gpu`)"
    ]
