"""End to end on CPU through the launcher: Ray, verl's FSDP2 engine, the seal_bfcl agent loop, the environment
service over HTTP, A-Patch and the capability state — including a killed run that resumes where it stopped,
and an environment service that dies mid-rollout.

These are the slowest tests (a few minutes each on 2 cores); they run in CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import alive, kill_session, processes, service_and_workers, wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TRAIN_TASKS = {"multi_turn_miss_func_121", "multi_turn_miss_func_122"}  # data/cpu_tiny_train.parquet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dirs(tmp: Path) -> dict[str, Path]:
    return {"ckpt": tmp / "ckpt", "run": tmp / "run"}


def launcher_cmd(tmp: Path, *extra: str) -> list[str]:
    d = run_dirs(tmp)
    return [
        sys.executable,
        str(REPO / "launcher.py"),
        "--conf",
        str(REPO / "exp" / "cpu_tiny.yaml"),
        f"trainer.default_local_dir={d['ckpt']}",
        f"seal.run_dir={d['run']}",  # diagnosis, logs, tables and plots all follow it
        f"env_service.port={free_port()}",
        *extra,
    ]


def launch(tmp: Path, *extra: str, log_name: str) -> subprocess.Popen:
    log = open(tmp / log_name, "w")
    return subprocess.Popen(
        launcher_cmd(tmp, *extra),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc.pid)  # the run and its Ray cluster, never another cluster on the machine
        pytest.fail(f"run did not finish within {timeout_s}s")


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Run A's launcher is killed (SIGKILL) right after its first checkpoint; run B, the same command, resumes it.

    The kill also checks that nothing of run A's environment outlives its launcher (the service, its workers, the
    run's secret file)."""
    tmp = tmp_path_factory.mktemp("cpu_tiny")
    ckpt = run_dirs(tmp)["ckpt"]
    run_a = launch(tmp, log_name="run_a.log")
    marker = ckpt / "global_step_1" / "seal_capability_state.json"
    deadline = time.monotonic() + 900
    while not marker.exists():
        if run_a.poll() is not None:
            pytest.fail(
                f"run A exited ({run_a.returncode}) before its first checkpoint:\n{(tmp / 'run_a.log').read_text()[-4000:]}"
            )
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    assert marker.exists(), "no checkpoint after step 1"
    time.sleep(2)  # let the checkpoint's remaining files land, then kill the launcher, and the launcher only
    environment = service_and_workers(run_a.pid)
    os.kill(run_a.pid, signal.SIGKILL)
    run_a.wait()
    wait_for(lambda: not alive(environment), 30, f"run A's environment service and workers {alive(environment)} alive")
    wait_for(lambda: not (run_dirs(tmp)["run"] / "env_service.secret").exists(), 5, "run A's secret file remains")
    kill_session(run_a.pid)  # what else the run left (Ray's own processes): only this test's cluster
    assert not (ckpt / "global_step_2").exists(), "run A got past step 1 before it was killed"
    run_b = launch(tmp, log_name="run_b.log")
    rc = wait(run_b, 900)
    log_b = (tmp / "run_b.log").read_text()
    assert rc == 0, log_b[-6000:]
    return tmp, log_b


def test_resumed_run_continues_at_the_next_step(resumed_run):
    tmp, log_b = resumed_run
    ckpt = run_dirs(tmp)["ckpt"]
    assert "Setting global step to 1" in log_b and "restored capability state" in log_b
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "Training Progress: 100%" in log_b or "step:2 " in log_b


def test_capability_state_and_dataloader_position_survive_the_kill(resumed_run):
    tmp, _ = resumed_run
    state = json.loads((run_dirs(tmp)["ckpt"] / "global_step_2" / "seal_capability_state.json").read_text())["state"]
    # 2 rollouts per step x 2 steps: step 1's observations came back from the checkpoint
    assert state["observe_count"] == 4
    # the dataloader resumed its position: step 2 trained the task step 1 had not (batch 1, one epoch)
    assert set(state["tasks"]) == TRAIN_TASKS
    assert all(record["count"] == 2 for record in state["tasks"].values())


def test_run_writes_metrics_diagnostics_checkpoint_and_validation_table(resumed_run):
    tmp, log_b = resumed_run
    d = run_dirs(tmp)
    # validation before training (step 0, run A) and at the end (run B), per category plus the average
    assert log_b.count("validation @ step") >= 2
    for category in ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"):
        assert category in log_b
    assert "val-core/average/reward/mean@1" in log_b
    table = (d["run"] / "validation_table.txt").read_text()
    assert table.startswith("validation @ step 2") and "multi_turn_long_context" in table and "average" in table
    # SEAL metrics reached the logger (A-Patch, capability state, rollout)
    for key in ("seal/apatch/mean_scale", "seal/state/observe_count", "seal/rollout/termination/", "actor/pg_loss"):
        assert key in log_b, key
    metrics_files = list((d["run"]).glob("metrics_*.jsonl"))
    assert metrics_files and any(f.stat().st_size > 0 for f in metrics_files)
    assert any((d["run"] / "tensorboard").iterdir())
    # per-epoch diagnostic dump and the persisted capability state
    dump = json.loads((d["run"] / "diagnostic_stats" / "epoch_0.json").read_text())
    assert dump["epoch"] == 0 and dump["tags"] and dump["dynamic_tag_weights"]
    assert (d["run"] / "diagnostic_state" / "seal_capability_state.json").exists()
    # every figure, after the resume too (label_shares.png from the epoch dump, at the run's last step)
    for figure in (
        "apatch_weights.png",
        "apatch_scales.png",
        "tag_shares.png",
        "label_shares.png",
        "accuracy_bands.png",
    ):
        assert (d["run"] / figure).stat().st_size > 1000, figure
    assert dump["global_step"] == 2
    # the last step's training metrics, written before its validation
    assert "actor/pg_loss" in json.loads((d["run"] / "metrics_steps.jsonl").read_text().splitlines()[-1])["data"]
    # best checkpoint recorded and exported to Hugging Face format
    best = json.loads((d["ckpt"] / "best_checkpoint.json").read_text())
    assert best["metric_name"] == "val-core/average/reward/mean@1"
    hf_dir = Path(best["checkpoint_dir"]) / "huggingface"
    assert (hf_dir / "config.json").exists() and any(hf_dir.glob("*.safetensors"))


def metric_values(log: str, key: str) -> list[float]:
    """Values of ``key`` in verl's console metric lines (``key:value`` pairs, numpy scalars included)."""
    return [
        float(line.split(f"{key}:")[1].split()[0].removeprefix("np.").split("(")[-1].rstrip(")"))
        for line in log.splitlines()
        if f"{key}:" in line
    ]


def test_unknown_tasks_fail_cleanly_in_training_and_validation_with_several_workers(tmp_path):
    """One real and one unknown task per batch, two agent-loop workers: the failed episodes' chunk and the real
    one must join (same keys, log-probs), the step completes, failures are counted, validation reports them apart."""
    import pandas as pd

    def with_unknown_task(src: str, dst: Path, ghost_id: str) -> str:
        data = pd.read_parquet(REPO / "data" / src).head(1)
        ghost = data.iloc[0].copy()
        ghost["extra_info"] = {**ghost["extra_info"], "task_id": ghost_id, "index": "ghost"}
        pd.concat([data, ghost.to_frame().T], ignore_index=True).to_parquet(dst)
        return str(dst)

    # two ghosts: preflight refuses a task both trained on and validated
    train = with_unknown_task("cpu_tiny_train.parquet", tmp_path / "train.parquet", "multi_turn_base_999998")
    val = with_unknown_task("cpu_tiny_heldout.parquet", tmp_path / "val.parquet", "multi_turn_base_999999")
    proc = launch(
        tmp_path,
        f"data.train_files={train}",
        f"data.val_files={val}",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        "trainer.total_training_steps=1",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "seal.checkpoint.save_best=false",
        "seal.rollout.episode_retries=0",
        "seal.validation.max_env_failure_share=1.0",
        "seal.preflight.prompt_budget=false",  # preflight would refuse the unknown task: the run-time path is tested
        log_name="unknown.log",
    )
    rc = wait(proc, 900)
    log = (tmp_path / "unknown.log").read_text()
    assert rc == 0, log[-6000:]
    assert metric_values(log, "seal/rollout/failed_episodes") == [2.0]  # both rollouts of the unknown task
    assert metric_values(log, "val-aux/env_failed/count") == [1.0]
    assert "actor/pg_loss" in log


def test_a_service_killed_mid_run_is_restarted_and_its_failed_step_stops_the_run(tmp_path):
    """The launcher's service is killed during step 2's rollout, after step 1's checkpoint. The launcher restarts it;
    the episodes it held fail (no retries here), so step 2's failure share passes the threshold and the run stops at
    step 2 in one line naming the service and its log, before the step's update and checkpoint: step 1's checkpoint,
    the last one made with a live environment, stays the latest and is not pruned."""
    d = run_dirs(tmp_path)
    proc = launch(
        tmp_path,
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "seal.rollout.episode_retries=0",
        "env_service.retries=0",
        "env_service.timeout_s=5",
        "actor_rollout_ref.rollout.agent.num_workers=2",  # as on GPU: chunks from two workers
        log_name="fault.log",
    )
    log_path = tmp_path / "fault.log"
    try:
        step_1 = d["ckpt"] / "global_step_1" / "seal_capability_state.json"
        wait_for(lambda: step_1.exists() or proc.poll() is not None, 900, "no checkpoint after step 1")
        assert proc.poll() is None, log_path.read_text()[-6000:]
        service = service_and_workers(proc.pid)[0]
        command = processes()[service]["cmd"].split()
        from env_service.client import EnvClient, EnvServiceError

        client = EnvClient(f"http://127.0.0.1:{command[command.index('--port') + 1]}", timeout_s=5, retries=0)

        def episodes_created() -> int:
            try:
                return client.health().get("created", 0)
            except EnvServiceError:  # 503 while a worker is being replaced
                return 0

        wait_for(lambda: episodes_created() > 2, 600, "step 2's rollout did not start")  # 2 episodes a step
        os.kill(service, signal.SIGKILL)
        rc = wait(proc, 900)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
    log = log_path.read_text()
    assert rc == 1, log[-6000:]
    assert f"(pid {service}, log {d['run'] / 'env_service.log'}) exited with code -9; restarting it" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("[seal] error: training step 2: ") and "max_env_failure_share" in last, log[-3000:]
    assert f"log {d['run'] / 'env_service.log'}" in last
    assert (d["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (d["ckpt"] / "global_step_1" / "actor").is_dir() and not (d["ckpt"] / "global_step_2").exists()
    assert not [pid for pid, p in processes().items() if f"--parent-pid {proc.pid}" in p["cmd"] and p["state"] != "Z"]
