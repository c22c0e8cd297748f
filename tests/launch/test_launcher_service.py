"""The launcher's environment service: its own (free port, fresh secret, identity checked), never a
stranger that happens to answer on the configured port; restarted when it dies; gone with its launcher."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from env_service.client import EnvClient, EnvServiceError
from env_service.http.service import ServerThread
from seal.launch import run_env
from seal.launch.recipe import PreflightError, compose_recipe
from seal.launch.service import environment_service
from tests.support.processes import alive, processes, service_and_workers, wait_for

ROOT = Path(__file__).resolve().parents[2]


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


# ---- the service's lifecycle: restarted when it dies, gone when its launcher is -----------------------------


def test_a_dead_service_is_restarted_on_the_url_its_clients_use(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SEAL_ENV_SECRET", raising=False)
    config = recipe(tmp_path, "env_service.serve.workers=1")
    env = config.env_service
    with environment_service(config) as url:
        first = service_and_workers(os.getpid())[0]
        os.kill(first, signal.SIGKILL)
        client = EnvClient(url, secret=Path(env.secret_file).read_text(), run_id=env.run_id, retries=0, timeout_s=5)

        def answers_again():
            try:
                return client.health().get("service_id") == env.service_id
            except EnvServiceError:  # not up again yet
                return False

        wait_for(answers_again, 120, "the killed service was not restarted")
        second = service_and_workers(os.getpid())[0]
        assert second != first
        assert client.create("multi_turn_base_0", "validate")["instance_id"]
        out = ""

        def restart_reported():  # the supervisor's own health check may answer after ours: its line comes then
            nonlocal out
            out += capsys.readouterr().out
            return "restarted (1 restart(s) in this run)" in out

        wait_for(restart_reported, 60, "the restart was not reported")
    out += capsys.readouterr().out
    assert f"(pid {first}, log {tmp_path / 'env_service.log'}) exited with code -9; restarting it" in out
    assert not alive([second])


def test_a_wedged_service_is_replaced_on_a_port_no_other_server_can_take(tmp_path, capsys, monkeypatch):
    """A service that answers nothing (SIGSTOP: alive, its port open, no reply) is killed and replaced within the
    bounded time; the port stays the launcher's throughout (nothing else can bind it), so clients keep the URL."""
    monkeypatch.delenv("SEAL_ENV_SECRET", raising=False)
    config = recipe(tmp_path, "env_service.serve.workers=0", "env_service.supervise.unresponsive_s=2")
    env = config.env_service
    with environment_service(config) as url:
        wedged = service_and_workers(os.getpid())[0]
        os.kill(wedged, signal.SIGSTOP)
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError):  # the launcher holds the port while its service hangs, and while it is replaced
            socket.create_server(("127.0.0.1", port))
        client = EnvClient(url, secret=Path(env.secret_file).read_text(), run_id=env.run_id, retries=0, timeout_s=5)
        wait_for(lambda: not alive([wedged]), 30, "the wedged service was not killed")
        assert wait_for(lambda: _answers(client, env.service_id), 60, "no service answers again")
        assert service_and_workers(os.getpid())[0] != wedged
        assert client.create("multi_turn_base_0", "validate")["instance_id"]
    out = capsys.readouterr().out
    said = re.search(
        rf"\(pid {wedged}, log {re.escape(str(tmp_path))}/env_service.log\) answered nothing for (\d+)s; restarting",
        out,
    )
    assert said and 2 <= int(said[1]) <= 5, out
    assert "restarted (1 restart(s) in this run)" in out


def _answers(client, service_id) -> bool:
    try:
        return client.health().get("service_id") == service_id
    except EnvServiceError:  # not up again yet
        return False


OWNER = """
import sys, time
from seal.launch.cli import exit_on_termination
from seal.launch.recipe import compose_recipe
from seal.launch.service import environment_service

@exit_on_termination
def run():
    config = compose_recipe("exp/cpu_tiny.yaml", ["seal.run_dir=" + sys.argv[1], "env_service.serve.workers=1"])
    with environment_service(config):
        print("up", flush=True)
        time.sleep(600)

run()
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_the_service_its_workers_and_the_secret_file_go_with_the_launcher(tmp_path, signum):
    """However the launcher ends (SIGKILL cannot be caught), its service and workers exit and its secret file goes."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert "up\n" in iter(owner.stdout.readline, ""), "the owner exited before its service was up"
        started = wait_for(
            lambda: service_and_workers(owner.pid)[2:] and service_and_workers(owner.pid), 60, "no workers"
        )
        assert (tmp_path / "env_service.secret").exists()
        owner.send_signal(signum)
        assert owner.wait(30) == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum)
        wait_for(lambda: not alive(started), 30, f"some of the service and its workers {started} still run")
        wait_for(lambda: not (tmp_path / "env_service.secret").exists(), 5, "the secret file is still there")
    finally:
        if owner.poll() is None:
            owner.kill()


# ---- the service holds the trainer's concurrency --------------------------------------------------------------


def test_the_recipes_peak_episodes_are_its_largest_batch_of_episodes():
    """exp/SEAL.yaml: 32 tasks x 8 rollouts a step, the 400 held-out tasks at once in validation (a multiple of the 8
    agent-loop workers: no padding); a run that never validates peaks at its training step; REMAX adds its greedy
    baselines; a validation batch is padded to the workers as verl pads it."""
    from seal.launch.service import peak_episodes

    seal = str(ROOT / "exp" / "SEAL.yaml")
    assert peak_episodes(compose_recipe(seal)) == 400
    assert peak_episodes(compose_recipe(seal, ["trainer.val_before_train=false", "trainer.test_freq=0"])) == 256
    remax = ["trainer.val_before_train=false", "trainer.test_freq=0", "algorithm.adv_estimator=remax"]
    assert peak_episodes(compose_recipe(seal, remax)) == 288
    assert peak_episodes(compose_recipe(seal, ["data.val_batch_size=101", "data.train_batch_size=4"])) == 104


def test_preflight_refuses_service_limits_below_the_recipes_concurrency():
    from seal.launch.preflight import _check_service_limits

    def problems(*overrides):
        found = []
        _check_service_limits(compose_recipe(str(ROOT / "exp" / "SEAL.yaml"), list(overrides)), found)
        return found

    assert problems() == []  # null limits: raised to hold the recipe
    assert problems("env_service.serve.max_requests_per_owner=100", "env_service.serve.peak_episodes=300") == [
        "env_service.serve.peak_episodes is 300, below the 400 episodes this recipe runs at once (train_batch_size x "
        "rollout.n, or the validation batch): leave it null (the recipe's) or raise it",
        "env_service.serve.max_requests_per_owner is 100, below the 400 episodes the trainer runs at once (one request "
        "each in flight; 800 leaves room for retries)",
    ]
    assert problems("+env_service.serve.max_episodes_per_owner=256") == [
        "env_service.serve.max_episodes_per_owner is 256, below the 400 episodes the trainer runs at once: set "
        "+env_service.serve.max_episodes_per_owner to at least that"
    ]
    assert problems("env_service.url=http://127.0.0.1:9", "env_service.serve.max_requests_per_owner=1") == []


def test_the_launcher_tells_its_service_the_trainers_peak_episodes(tmp_path):
    """exp/cpu_tiny.yaml validates its 4 held-out tasks at once (its step has 2 episodes)."""
    config = recipe(tmp_path, "env_service.serve.workers=0")
    with environment_service(config):
        command = processes()[service_and_workers(os.getpid())[0]]["cmd"].split()
        assert command[command.index("--peak-episodes") + 1] == "4"


RESTART_BUDGET_OWNER = """
import sys, time
from seal.launch.recipe import compose_recipe
from seal.launch.service import RunStopped, environment_service

config = compose_recipe(
    "exp/cpu_tiny.yaml",
    ["seal.run_dir=" + sys.argv[1], "env_service.serve.workers=0", "env_service.supervise.max_restarts=1"],
)
try:
    with environment_service(config):
        print("up", flush=True)
        time.sleep(600)
except RunStopped as stopped:
    print(f"[seal] error: {stopped}", flush=True)
    sys.exit(1)
"""


def test_past_its_restart_budget_the_run_stops_with_one_line_naming_why(tmp_path):
    """max_restarts=1: the first death is restarted, the second ends the run (the main thread is stopped wherever it
    waits, as a Ctrl-C would), with one line naming the service, the budget and the key."""
    owner = subprocess.Popen(
        [sys.executable, "-c", RESTART_BUDGET_OWNER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        lines = iter(owner.stdout.readline, "")
        assert "up\n" in lines, "the owner exited before its service was up"
        first = service_and_workers(owner.pid)[0]
        os.kill(first, signal.SIGKILL)
        assert any("restarted (1 restart(s) in this run)" in line for line in lines)
        second = service_and_workers(owner.pid)[0]
        os.kill(second, signal.SIGKILL)
        assert owner.wait(60) == 1
        last = owner.stdout.read().strip().splitlines()[-1]
        assert last == (
            f"[seal] error: the environment service at {last.split('at ', 1)[1].split(' ', 1)[0]} (pid {second}, log "
            f"{tmp_path / 'env_service.log'}) exited with code -9 after 1 restart(s), the most "
            "env_service.supervise.max_restarts allows: the run stops"
        )
    finally:
        if owner.poll() is None:
            owner.kill()


def test_each_run_logs_into_its_own_folder_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    """Before: the second run started from one process (a sweep in a notebook, a run after the node services of
    another) found the first run's logger locations in the environment and wrote its metrics into that run's folder."""
    for key in ("TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH", run_env.LOGGERS_OF_RUN):
        monkeypatch.delenv(key, raising=False)
    first, second = tmp_path / "first", tmp_path / "second"
    run_env.set_run_environment(recipe(first))
    metrics_file = os.environ["VERL_FILE_LOGGER_PATH"]
    assert Path(metrics_file).parent == first and os.environ["TENSORBOARD_DIR"] == str(first / "tensorboard")
    run_env.set_run_environment(recipe(first))  # the same run again: the same metrics file
    assert os.environ["VERL_FILE_LOGGER_PATH"] == metrics_file
    run_env.set_run_environment(recipe(second))
    assert Path(os.environ["VERL_FILE_LOGGER_PATH"]).parent == second
    assert os.environ["TENSORBOARD_DIR"] == str(second / "tensorboard")
    monkeypatch.delenv(run_env.LOGGERS_OF_RUN)  # a fresh process where the user chose where tensorboard writes
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "mine"))
    run_env.set_run_environment(recipe(first))
    assert os.environ["TENSORBOARD_DIR"] == str(tmp_path / "mine")
