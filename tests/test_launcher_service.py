"""The launcher's environment service: its own (free port, fresh secret, identity checked), never a
stranger that happens to answer on the configured port."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import requests

from env_service.client import EnvClient
from env_service.service import ServerThread
from seal.launch import PreflightError, compose_recipe, environment_service

ROOT = Path(__file__).resolve().parents[1]


def recipe(tmp_path, *overrides: str):
    return compose_recipe(str(ROOT / "exp" / "cpu_tiny.yaml"), [f"seal.run_dir={tmp_path}", *overrides])


def test_a_foreign_server_on_the_configured_port_is_not_used(tmp_path):
    with ServerThread() as stranger:  # answers /health like any env service, but is not this run's
        config = recipe(tmp_path, f"env_service.port={stranger.port}")
        with pytest.raises(PreflightError, match="taken by another server"):
            with environment_service(config):
                pytest.fail("the launcher used a service it did not start")
        assert stranger.manager.stats()["created"] == 0


def test_the_launcher_starts_its_own_service_with_a_fresh_secret(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SEAL_ENV_SECRET", raising=False)
    config = recipe(tmp_path)
    env = config.env_service
    with environment_service(config) as url:
        secret_file = Path(env.secret_file)
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        secret = secret_file.read_text()
        assert len(secret) >= 32 and env.run_id and env.service_id
        health = requests.get(url + "/health", timeout=10).json()
        assert health["service_id"] == env.service_id
        assert requests.get(url + "/profile", timeout=10).status_code == 401  # the secret is required
        client = EnvClient(url, secret=secret, run_id=env.run_id, retries=0)
        assert client.create("multi_turn_base_0", "validate")["instance_id"]
        # clients of the run's processes (and of the Ray cluster it starts) find it in the environment
        assert os.environ["SEAL_ENV_SECRET"] == secret and EnvClient(url, retries=0).get_profile()["version"] == 0
    assert "SEAL_ENV_SECRET" not in os.environ
    assert secret not in capsys.readouterr().out + (tmp_path / "env_service.log").read_text()
    assert not secret_file.exists()  # the run's secret does not outlive it
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=5)


def test_a_user_run_service_is_used_with_its_secret(tmp_path, monkeypatch):
    with ServerThread(secret="users-secret") as theirs:
        config = recipe(tmp_path, f"env_service.url={theirs.url}")
        monkeypatch.setenv("SEAL_ENV_SECRET", "users-secret")
        with environment_service(config) as url:
            assert url == theirs.url
        assert not os.path.exists(tmp_path / "env_service.secret")
