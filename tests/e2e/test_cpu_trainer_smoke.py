"""End to end: verl's own RayPPOTrainer (legacy path) trains the tiny model on CPU.

Goes through verl's normal entry (`run_ppo` + verl's own `main_ppo_v0.TaskRunner`, not seal's) with the
embedded CPU recipe (`exp/cpu_tiny.yaml`: FSDP2 actor and reference on gloo, the `hf` rollout server) on a toy
single-turn task with verl's `single_turn_agent`: GRPO with n=2, validation before training, two steps, a
checkpoint after each. It shows the CPU backend is a plain verl backend, independent of seal's trainer.

It runs with the GPU recipe's memory savers on, as a real-size model on CPU needs them: gradient checkpointing
(the actor's checkpointed backward on gloo) and an offloaded reference (FSDP2's CPU-offload policy must not pin
memory without an accelerator; ``seal.cpu.platform`` drops the pinning).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_DIR = Path(os.environ.get("SEAL_TINY_MODEL_DIR", REPO / ".cache" / "tiny-qwen"))

REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of ASCII characters: varies between samples, so GRPO advantages are non-zero."""
    return sum(c.isascii() for c in solution_str) / max(1, len(solution_str))
'''


def _write_data(root: Path) -> Path:
    import pandas as pd

    questions = ["What is 2 + 2?", "Name a color.", "Say hello.", "Count to three."]
    rows = [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": q}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": "x"},
            "extra_info": {"index": i, "split": "train"},
        }
        for i, q in enumerate(questions)
    ]
    path = root / "toy.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


def _compose(model_dir: Path, data: Path, reward: Path, ckpt: Path):
    from seal.launch.recipe import compose_recipe

    run = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=true",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.total_training_steps=2",
        "trainer.total_epochs=2",
        "trainer.val_before_train=true",
        "trainer.test_freq=-1",
        "trainer.save_freq=1",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={ckpt}",
        "trainer.rollout_data_dir=null",
        "trainer.validation_data_dir=null",
        "trainer.project_name=seal_smoke",
        "trainer.experiment_name=cpu",
        "trainer.logger=[console,file]",
    ]
    return compose_recipe(str(REPO / "exp" / "cpu_tiny.yaml"), run)


def _read_metrics(path: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record["data"])
    return by_step


def run_driver(workdir: Path) -> None:
    """What a launcher does: build/compose, then verl's run_ppo with the stock TaskRunner."""
    from seal.cpu.tiny_model import build_tiny_model

    model_dir = build_tiny_model(TINY_DIR)
    reward = workdir / "reward.py"
    reward.write_text(REWARD_SOURCE)
    config = _compose(model_dir, _write_data(workdir), reward, workdir / "ckpt")

    import ray
    from verl.trainer import main_ppo_v0
    from verl.trainer.main_ppo import run_ppo

    start = time.perf_counter()
    try:
        run_ppo(config, task_runner_class=main_ppo_v0.TaskRunner)
    finally:
        ray.shutdown()
    print(f"[smoke] run_ppo wall time: {time.perf_counter() - start:.1f}s", flush=True)


@pytest.mark.slow
def test_ray_ppo_trainer_runs_on_cpu(tmp_path):
    from seal.cpu.platform import cpu_runtime_env

    # A fresh driver process, like a launcher: VERL_PLATFORM=cpu must be set before verl is
    # imported (the plugin registers the platform at import), and the run must not leak Ray or
    # platform state into this pytest process.
    metrics = {"VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl")}  # the "file" logger writes JSONL here
    env = {**os.environ, **cpu_runtime_env(metrics), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "driver.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, __file__, str(tmp_path)], env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600
        )
    elapsed = time.perf_counter() - start
    print(f"smoke driver: rc={proc.returncode} in {elapsed:.1f}s")
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert (
        "'enable_gradient_checkpointing': True" in text and "'param_offload': True" in text
    )  # the savers reached verl

    steps = _read_metrics(tmp_path / "metrics.jsonl")
    val = {k: v for k, v in steps.get(0, {}).items() if k.startswith("val-core/")}
    assert "val-core/toy/acc/mean@1" in val, sorted(steps.get(0, {}))
    for step in (1, 2):
        train = steps[step]
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "critic/score/mean",
            "response_length/mean",
            "timing_s/step",
            "timing_s/ref",
        ):  # the offloaded reference computed its log-probs
            assert key in train, (step, key)
        assert train["actor/grad_norm"] > 0, (step, train["actor/grad_norm"])  # the checkpointed backward ran
        # The rollout server's log-probs equal the trainer's own forward pass, so its weights are the
        # actor's: synced at step 0 and again after step 1's update (lr=1e-2 moves every weight; a
        # skipped sync shows up here as KL ~2e-2 and a probs diff ~3e-6).
        assert abs(train["rollout_corr/kl"]) < 1e-4, (step, train["rollout_corr/kl"])
        assert train["training/rollout_probs_diff_max"] < 1e-8, (step, train["training/rollout_probs_diff_max"])
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "global_step_1" / "actor").is_dir() and (ckpt / "global_step_2" / "actor").is_dir()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


if __name__ == "__main__":
    run_driver(Path(sys.argv[1]))
