"""Access control of the real service: loopback by default, a shared secret on every endpoint but
/health, and failure profiles that belong to the run that pushed them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from env_service.client import EnvClient, EnvServiceError, InProcessEnvClient, ProfileFanOut, make_client
from env_service.episodes.manager import MAX_RUN_PROFILES, EpisodeManager
from env_service.http.auth import read_secret_file, resolve_secret
from env_service.http.service import ServerThread
from seal.eval.serve import free_port

REPO = Path(__file__).resolve().parents[2]
TASK = "multi_turn_base_0"
SECRET = "correct horse battery staple"
CUE_PROFILE = {"tags": {"missing_tool_call": {"count": 40, "reward_mean": 0.1}}}
CUE_PARAMS = {"capability_cues": {"enable": True}}
CUES = "# Behavioral guidelines"


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager(), secret=SECRET, service_id="svc-under-test") as srv:
        yield srv


ENDPOINTS = [
    ("post", "/create", {"task_id": TASK, "mode": "validate"}),
    ("post", "/step", {"instance_id": "x", "content": "hi"}),
    ("post", "/evaluate", {"instance_id": "x"}),
    ("post", "/release", {"instance_id": "x"}),
    ("post", "/touch", {"instance_id": "x"}),
    ("post", "/profile", {"profile": CUE_PROFILE}),
    ("get", "/profile", None),
    ("get", "/openapi.json", None),
    ("get", "/docs", None),
]


@pytest.mark.parametrize("method,path,body", ENDPOINTS, ids=[f"{m}{p}" for m, p, _ in ENDPOINTS])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Bearer {SECRET}x", SECRET, f"bearer {SECRET}"])
def test_every_endpoint_but_health_needs_the_secret(server, method, path, body, auth):
    headers = {"Authorization": auth} if auth else {}
    response = requests.request(method, server.url + path, json=body, headers=headers, timeout=10)
    assert response.status_code == 401, response.text[:200]
    assert response.json()["error"] == "unauthorized" and SECRET not in response.text


def test_every_route_of_the_service_is_in_the_secret_check():
    from env_service.http.endpoints import ENDPOINTS as ROUTES

    checked = {(method.upper(), path) for method, path, _ in ENDPOINTS}
    assert {(e.method, f"/{e.path}") for e in ROUTES} <= checked


def test_health_is_open_and_names_the_service(server):
    health = requests.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["service_id"] == "svc-under-test"


def test_client_with_the_secret_runs_an_episode(server):
    client = EnvClient(server.url, retries=0, secret=SECRET)
    created = client.create(TASK, "validate")
    assert not client.step(created["instance_id"], "Done.")["terminated"]
    assert client.evaluate(created["instance_id"], release=True)["num_steps"] == 1
    with pytest.raises(EnvServiceError) as err:
        EnvClient(server.url, retries=3, backoff_s=0.0).create(TASK, "validate")
    assert err.value.status == 401


def test_profiles_belong_to_the_run_that_pushed_them(server):
    run_a = make_client(server.url, run_id="run-a", secret=SECRET, retries=0)
    run_b = make_client(server.url, run_id="run-b", secret=SECRET, retries=0)
    anonymous = make_client(server.url, secret=SECRET, retries=0)
    version = run_a.set_profile(CUE_PROFILE)["version"]
    assert run_a.get_profile()["profile"] == CUE_PROFILE and run_a.get_profile()["version"] == version
    assert run_b.get_profile()["profile"] is None and anonymous.get_profile()["profile"] is None
    episodes = {
        name: c.create(TASK, "train", CUE_PARAMS) for name, c in [("a", run_a), ("b", run_b), ("anonymous", anonymous)]
    }
    assert CUES in episodes["a"]["messages"][0]["content"] and episodes["a"]["info"]["profile_version"] == version
    for other in ("b", "anonymous"):
        assert CUES not in episodes[other]["messages"][0]["content"]
        assert episodes[other]["info"]["profile_version"] is None
    owners = {name: server.manager._slots[e["instance_id"]].owner for name, e in episodes.items()}
    assert owners == {"a": "run:run-a", "b": "run:run-b", "anonymous": "addr:loopback"}  # sources never collide
    for name, client in [("a", run_a), ("b", run_b), ("anonymous", anonymous)]:
        client.release(episodes[name]["instance_id"])


def test_in_process_client_keeps_profiles_per_run_too():
    manager = EpisodeManager()
    run_a, run_b = InProcessEnvClient(manager, run_id="a"), InProcessEnvClient(manager, run_id="b")
    run_a.set_profile(CUE_PROFILE)
    assert CUES in run_a.create(TASK, "train", CUE_PARAMS)["messages"][0]["content"]
    assert CUES not in run_b.create(TASK, "train", CUE_PARAMS)["messages"][0]["content"]


def test_bad_run_id_is_refused(server):
    response = requests.get(
        server.url + "/profile", timeout=10, headers={"Authorization": f"Bearer {SECRET}", "X-Seal-Run-Id": "x" * 500}
    )
    assert response.status_code == 400 and "run id" in response.json()["detail"]


def test_stored_profiles_are_bounded():
    manager = EpisodeManager()
    for i in range(MAX_RUN_PROFILES + 1):
        manager.set_profile(CUE_PROFILE, run_id=f"run-{i}")
    assert manager.get_profile("run-0")["profile"] is None  # the oldest push was dropped
    assert manager.get_profile(f"run-{MAX_RUN_PROFILES}")["profile"] == CUE_PROFILE


def test_profile_fan_out_reaches_every_service():
    managers = [EpisodeManager(), EpisodeManager()]
    fan_out = ProfileFanOut([InProcessEnvClient(m, run_id="r") for m in managers])
    assert len(fan_out.set_profile(CUE_PROFILE)) == 2
    assert all(m.get_profile("r")["profile"] == CUE_PROFILE for m in managers)


def test_binding_beyond_loopback_needs_a_secret():
    with pytest.raises(ValueError, match="secret"):
        ServerThread(host="0.0.0.0")
    with ServerThread(host="0.0.0.0", secret=SECRET) as srv:  # with one it serves, and checks it
        url = f"http://127.0.0.1:{srv.port}"
        assert requests.post(url + "/create", json={"task_id": TASK, "mode": "validate"}, timeout=10).status_code == 401
        assert EnvClient(url, secret=SECRET, retries=0).health()["status"] == "ok"


def test_secret_sources(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(str(path))
    path.chmod(0o600)
    assert resolve_secret(secret_file=str(path)) == SECRET
    monkeypatch.setenv("SEAL_ENV_SECRET", "from-env")
    assert resolve_secret() == "from-env" and resolve_secret("explicit") == "explicit"
    monkeypatch.delenv("SEAL_ENV_SECRET")
    assert resolve_secret() is None


def test_serve_cli_refuses_a_public_address_without_a_secret_and_enforces_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SEAL_ENV_SECRET"}
    refused = subprocess.run(
        [sys.executable, "-m", "env_service", "serve", "--host", "0.0.0.0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "secret" in refused.stderr and "Traceback" not in refused.stderr
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "env_service",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            "--secret-file",
            str(secret_file),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                requests.get(url + "/health", timeout=2)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "service did not come up"
                time.sleep(0.2)
        assert requests.get(url + "/profile", timeout=10).status_code == 401
        assert EnvClient(url, secret=SECRET, retries=0).get_profile()["version"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
