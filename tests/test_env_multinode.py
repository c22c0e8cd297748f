"""Several nodes on one machine (two Ray nodes): one environment service per node, owned by an actor on
that node; each worker uses its own node's service; a failure profile reaches every service; the preflight node check
passes on both."""

from __future__ import annotations

import pytest
import requests
from omegaconf import OmegaConf

from env_service.client import EnvClient, make_client
from seal import env_clients
from seal.launch import env_services

CUE_PROFILE = {"tags": {"missing_tool_call": {"count": 40, "reward_mean": 0.1}}}
CUE_PARAMS = {"capability_cues": {"enable": True}}
RUN = "multinode-run"


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
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
def test_one_service_per_node_used_by_that_nodes_workers_and_profiles_reach_all(cluster):
    ray = cluster
    secret, service_id = env_services.new_secret(), env_services.new_service_id()
    nodes = env_services.start_node_services(secret, service_id, ["--workers", "0"])
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
    finally:
        env_services.stop_node_services(service_id, list(nodes))
    for url in nodes.values():
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=5)


@pytest.mark.slow
def test_both_nodes_pass_the_node_check(cluster, tmp_path, monkeypatch):
    """Two Ray nodes on one machine share its filesystem, repository and venv: the check runs on each and finds
    nothing; a third node asked for is refused."""
    from pathlib import Path

    from seal.launch import compose_recipe, multinode

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
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

    from seal.launch import compose_recipe, environment_service

    ray = cluster
    address = ray.get_runtime_context().gcs_address
    ray.shutdown()  # the launcher connects (and disconnects) itself
    config = compose_recipe(
        str(Path(__file__).resolve().parents[1] / "exp" / "cpu_tiny.yaml"),
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
