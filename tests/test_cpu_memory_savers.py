"""CPU with a real-size model needs the memory savers of the GPU recipe: gradient checkpointing and an offloaded
reference. One GRPO step of verl's own trainer on CPU (the smoke setup of ``test_cpu_trainer_smoke.py``) with
``model.enable_gradient_checkpointing: true`` and ``ref.fsdp_config.param_offload: true``: the reference's FSDP2
CPU-offload policy must not pin memory (no accelerator; ``seal.cpu_platform`` drops the pinning) and the actor's
checkpointed backward must run on gloo.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def run_driver(workdir: Path) -> None:
    sys.path.insert(0, str(HERE))
    import ray
    from omegaconf import OmegaConf
    from test_cpu_trainer_smoke import REWARD_SOURCE, TINY_DIR, _compose, _write_data
    from verl.trainer import main_ppo_v0
    from verl.trainer.main_ppo import run_ppo

    from seal.tiny_model import build_tiny_model

    reward = workdir / "reward.py"
    reward.write_text(REWARD_SOURCE)
    config = _compose(build_tiny_model(TINY_DIR), _write_data(workdir), reward, workdir / "ckpt")
    OmegaConf.set_struct(config, False)
    config.actor_rollout_ref.model.enable_gradient_checkpointing = True
    config.actor_rollout_ref.ref.fsdp_config.param_offload = True
    config.trainer.update({"total_training_steps": 1, "val_before_train": False, "save_freq": -1})
    try:
        run_ppo(config, task_runner_class=main_ppo_v0.TaskRunner)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_gradient_checkpointing_and_reference_offload_train_on_cpu(tmp_path):
    from test_cpu_trainer_smoke import _read_metrics

    from seal.cpu_platform import cpu_runtime_env

    env = {**os.environ, **cpu_runtime_env({"VERL_FILE_LOGGER_PATH": str(tmp_path / "metrics.jsonl")})}
    log = tmp_path / "driver.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=600)
    print(f"driver: rc={proc.returncode} in {time.perf_counter() - start:.1f}s")
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert "'enable_gradient_checkpointing': True" in text and "'param_offload': True" in text  # the settings reached verl
    step = _read_metrics(tmp_path / "metrics.jsonl")[1]
    assert math.isfinite(step["actor/grad_norm"]) and step["actor/grad_norm"] > 0  # the checkpointed backward ran
    assert "timing_s/ref" in step  # the offloaded reference computed its log-probs
    assert step["training/rollout_probs_diff_max"] < 1e-8  # and the rollout still has the actor's weights


if __name__ == "__main__":
    run_driver(Path(sys.argv[1]))
