"""End to end on CPU through the launcher: Ray, verl's FSDP2 engine, the seal_bfcl agent loop, the environment
service over HTTP, A-Patch and the capability state — including a killed run that resumes where it stopped,
and an environment service that dies mid-rollout.

These are the slowest tests (a few minutes each on 2 cores); they run in CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from env_service.bfcl.interface import CUES_HEADER
from seal.eval.serve import free_port
from seal.report.reproduction import swap_values
from tests.support.processes import alive, kill_session, processes, service_and_workers, wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TRAIN_TASKS = {"multi_turn_miss_func_121", "multi_turn_miss_func_122"}  # data/cpu_tiny_train.parquet


def run_dirs(tmp: Path) -> dict[str, Path]:
    return {"ckpt": tmp / "ckpt", "run": tmp / "run"}


#: The CPU swap's tiny model (its small BFCL-trained vocabulary) instead of cpu_tiny's real 152k-token Qwen one:
#: the logits over 152k tokens are most of a CPU step (~70 s against ~10 s), and nothing these tests check depends
#: on the vocabulary. The README's run of exp/cpu_tiny.yaml (.ci/run) trains the real one.
SMALL_VOCABULARY = tuple(
    f"{key}={swap_values()[key]}"
    for key in ("seal.tiny_model.shape", "seal.tiny_model.out_dir", "actor_rollout_ref.model.path")
)


def launcher_cmd(tmp: Path, *extra: str) -> list[str]:
    d = run_dirs(tmp)
    return [
        sys.executable,
        str(REPO / "launcher.py"),
        "--conf",
        str(REPO / "exp" / "cpu_tiny.yaml"),
        *SMALL_VOCABULARY,
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


#: The resume runs: 2 epochs of the 2 train tasks (batch 1: an epoch is 2 steps), a checkpoint every 2 steps,
#: capability cues that a tiny model's failures trigger at once. data.seed 2: epoch 1 starts with the other task
#: (with verl's sampler too), so a resume that walked epoch 0's order again would show.
RESUME_RUN = (
    "trainer.total_epochs=2",
    "trainer.total_training_steps=4",
    "trainer.save_freq=2",
    "data.seed=2",
    "env_service.bfcl.capability_cues.enable=true",
    "env_service.bfcl.capability_cues.min_tag_count=1",
    "env_service.bfcl.capability_cues.prevalence_threshold=0.0",
)


def logged_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def rollouts(path: Path) -> list[dict]:
    """verl's dump of a training step's samples (``trainer.rollout_data_dir``: input, output, gts per sample)."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except (FileNotFoundError, ValueError):  # not written yet, or being written
        return []


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Run A is killed (SIGKILL) in step 4, past the checkpoint of step 2 (the end of epoch 0) and after step 3
    had been trained, logged and dumped: up to there it is the uninterrupted run. Run B, the same command,
    resumes it from step 2 to step 4; its step 3 must be A's step 3.

    The kill (of the launcher alone) also checks that nothing of run A's environment outlives it (the service, its
    workers, the run's secret file)."""
    tmp = tmp_path_factory.mktemp("cpu_tiny")
    d = run_dirs(tmp)
    step_3 = d["run"] / "rollout_log" / "3.jsonl"
    run_a = launch(tmp, *RESUME_RUN, log_name="run_a.log")
    deadline = time.monotonic() + 1200
    while len(rollouts(step_3)) < 2:  # the step's 2 samples
        if run_a.poll() is not None:
            pytest.fail(f"run A exited ({run_a.returncode}) before step 3:\n{(tmp / 'run_a.log').read_text()[-4000:]}")
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    environment = service_and_workers(run_a.pid)
    os.kill(run_a.pid, signal.SIGKILL)
    run_a.wait()
    wait_for(lambda: not alive(environment), 30, f"run A's environment service and workers {alive(environment)} alive")
    wait_for(lambda: not (d["run"] / "env_service.secret").exists(), 5, "run A's secret file remains")
    kill_session(run_a.pid)  # what else the run left (Ray's own processes): only this test's cluster
    assert len(rollouts(step_3)) == 2, "run A did not reach step 3"
    assert (d["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    uninterrupted = {step: rollouts(d["run"] / "rollout_log" / f"{step}.jsonl") for step in (1, 2, 3)}
    best_before = json.loads((d["ckpt"] / "best_checkpoint.json").read_text())
    run_b = launch(tmp, *RESUME_RUN, log_name="run_b.log")
    rc = wait(run_b, 900)
    log_b = (tmp / "run_b.log").read_text()
    assert rc == 0, log_b[-6000:]
    return tmp, log_b, best_before, uninterrupted


def test_resumed_run_continues_at_the_next_step(resumed_run):
    tmp, log_b, _, _ = resumed_run
    ckpt = run_dirs(tmp)["ckpt"]
    assert "Setting global step to 2" in log_b and "restored capability state" in log_b
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "Training Progress: 100%" in log_b or "step:4 " in log_b


def test_capability_state_and_dataloader_position_survive_the_kill(resumed_run):
    tmp, _, _, _ = resumed_run
    state = json.loads((run_dirs(tmp)["ckpt"] / "global_step_4" / "seal_capability_state.json").read_text())["state"]
    # 2 rollouts per step x 4 steps: steps 1-2 came back from the checkpoint, step 3 was not counted twice
    assert state["observe_count"] == 8
    # each epoch trained each task once (batch 1, 2 tasks, 2 epochs)
    assert set(state["tasks"]) == TRAIN_TASKS
    assert all(record["count"] == 4 for record in state["tasks"].values())


def resumed_step_3(resumed_run) -> list[dict]:
    return rollouts(run_dirs(resumed_run[0])["run"] / "rollout_log" / "3.jsonl")


def test_the_first_resumed_step_is_the_uninterrupted_runs_step(resumed_run):
    """Across the epoch boundary the same task, with the same capability cues in its prompts (the restored
    profile reached the new service before the rollout)."""
    uninterrupted = resumed_run[3]
    assert uninterrupted[3][0]["gts"] != uninterrupted[1][0]["gts"], "epoch 1 starts as epoch 0 did: nothing to see"
    resumed = resumed_step_3(resumed_run)
    assert [s["gts"] for s in resumed] == [s["gts"] for s in uninterrupted[3]]
    assert all(CUES_HEADER in s["input"] for s in uninterrupted[3])
    assert sorted(s["input"] for s in resumed) == sorted(s["input"] for s in uninterrupted[3])


def test_the_resumed_run_does_not_repeat_earlier_samples(resumed_run):
    uninterrupted = resumed_run[3]
    earlier = {s["output"] for step in (1, 2) for s in uninterrupted[step]}
    resumed = {s["output"] for s in resumed_step_3(resumed_run)}
    assert len(resumed) == 2 and not resumed & earlier
    # the same seeds on the same weights (restored exactly, fp32 on CPU): the uninterrupted step's samples
    assert resumed == {s["output"] for s in uninterrupted[3]}


def test_each_step_is_in_the_metric_files_once(resumed_run):
    tmp, _, _, _ = resumed_run
    run = run_dirs(tmp)["run"]
    assert logged_steps(run / "metrics_steps.jsonl") == [1, 2, 3, 4]  # run A had logged step 3 before the kill
    trained = [  # verl's file logger: one file per launch
        entry["step"]
        for path in sorted(run.glob("metrics_2*.jsonl"))
        for entry in map(json.loads, path.read_text().splitlines())
        if "actor/pg_loss" in entry["data"]
    ]
    assert sorted(trained) == [1, 2, 3, 4]


def test_the_resumes_revalidation_does_not_replace_the_best_record(resumed_run):
    tmp, log_b, best_before, _ = resumed_run
    assert "validation @ step 2" in log_b  # verl validates the resumed checkpoint again
    assert best_before["validation"]["step"] == best_before["global_step"] == 2
    best = json.loads((run_dirs(tmp)["ckpt"] / "best_checkpoint.json").read_text())
    assert best == best_before or best["validation"]["step"] == best["global_step"] == 4


def test_run_writes_metrics_diagnostics_checkpoint_and_validation_table(resumed_run):
    tmp, log_b, _, _ = resumed_run
    d = run_dirs(tmp)
    # validation before training (step 0, run A), of the resumed checkpoint and at the end (run B), per category
    # plus the average
    assert log_b.count("validation @ step") >= 2
    for category in ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"):
        assert category in log_b
    assert "val-core/average/reward/mean@1" in log_b
    table = (d["run"] / "validation_table.txt").read_text()
    assert table.startswith("validation @ step 4") and "multi_turn_long_context" in table and "average" in table
    # SEAL metrics reached the logger (A-Patch, capability state, rollout)
    for key in ("seal/apatch/mean_scale", "seal/state/observe_count", "seal/rollout/termination/", "actor/pg_loss"):
        assert key in log_b, key
    metrics_files = list((d["run"]).glob("metrics_*.jsonl"))
    assert metrics_files and any(f.stat().st_size > 0 for f in metrics_files)
    assert any((d["run"] / "tensorboard").iterdir())
    # per-epoch diagnostic dumps, each at its epoch's last step, and the persisted capability state
    for epoch, last_step in ((0, 2), (1, 4)):
        dump = json.loads((d["run"] / "diagnostic_stats" / f"epoch_{epoch}.json").read_text())
        assert dump["epoch"] == epoch and dump["tags"] and dump["dynamic_tag_weights"]
        assert dump["global_step"] == last_step
    assert (d["run"] / "diagnostic_state" / "seal_capability_state.json").exists()
    # every figure, after the resume too (label_shares.png from the epoch dumps)
    for figure in (
        "apatch_weights.png",
        "apatch_scales.png",
        "tag_shares.png",
        "label_shares.png",
        "accuracy_bands.png",
    ):
        assert (d["run"] / figure).stat().st_size > 1000, figure
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
        "seal.validation.max_other_failure_share=1.0",  # an unknown task is the task data's failure
        "seal.preflight.prompt_budget=false",  # preflight would refuse the unknown task: the run-time path is tested
        log_name="unknown.log",
    )
    rc = wait(proc, 900)
    log = (tmp_path / "unknown.log").read_text()
    assert rc == 0, log[-6000:]
    assert metric_values(log, "seal/rollout/failed_episodes") == [2.0]  # both rollouts of the unknown task
    assert metric_values(log, "seal/failed_episodes/task_data") == [2.0]  # ... named for what failed
    assert metric_values(log, "seal/failed_episodes/environment") == [0.0]
    assert metric_values(log, "val-aux/failed_episodes/task_data/count") == [1.0]
    assert metric_values(log, "val-aux/failed_episodes/environment/count") == [0.0]
    assert "actor/pg_loss" in log


def test_a_service_wedged_mid_run_is_restarted_and_its_failed_step_stops_the_run(tmp_path):
    """The launcher's service hangs (SIGSTOP: alive, its port open, answering nothing) during step 2's rollout, after
    step 1's checkpoint. The launcher's health probe finds it silent, kills it and starts another on the same port;
    the episodes it held fail (no retries here), so step 2's failure share passes the threshold and the run stops at
    step 2 in one line naming the service and its log, as the step's rollout returns (before its log-probs, update
    and checkpoint): nothing of step 2 is checkpointed, and step 1's checkpoint, the last one made with a live
    environment, stays the latest and is not pruned. (A service that dies is restarted the same way:
    tests/launch/test_launcher_service.py.)"""
    d = run_dirs(tmp_path)
    proc = launch(
        tmp_path,
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "seal.rollout.episode_retries=0",
        "env_service.retries=0",
        "env_service.timeout_s=60",  # the clients wait on the hung service: its replacement is what ends their wait
        "env_service.supervise.unresponsive_s=5",
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
        os.kill(service, signal.SIGSTOP)
        rc = wait(proc, 900)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
    log = log_path.read_text()
    assert rc == 1, log[-6000:]
    assert f"(pid {service}, log {d['run'] / 'env_service.log'}) answered nothing for " in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("[seal] error: training step 2: ") and "max_env_failure_share" in last, log[-3000:]
    assert f"log {d['run'] / 'env_service.log'}" in last
    assert (d["ckpt"] / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (d["ckpt"] / "global_step_1" / "actor").is_dir() and not (d["ckpt"] / "global_step_2").exists()
    assert not [pid for pid, p in processes().items() if f"--parent-pid {proc.pid}" in p["cmd"] and p["state"] != "Z"]
