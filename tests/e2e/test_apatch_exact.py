"""Stage A's controls (``scripts/apatch_exact.py``, docs/learning-check.md), on the real pieces: the candidates'
episodes played by the environment's episode code, verl's GRPO, ``SealTrainer._seal_step``, verl's actor loss and
the released recipe's optimizer, on the tiny ``bfcl_bpe`` model (its initial weights: the controls hold for any
weights, and the warm start takes minutes), the shared prompt cut to its last 256 tokens (``apatch_exact.shortened``:
the 3.3k-token prompt is most of an update's cost, and the controls are about the pipeline after it).

- negative control: A-Patch on with every tag weight and both bounds 1 is A-Patch off, to the last bit, through
  two AdamW updates (the closed loop's second step and the optimizer's state included); A-Patch on is not;
- positive control: under plain SGD the decoys' scales show through: one update lowers log pi(heavy) -
  log pi(light) most with A-Patch on (heavy 2.0, light 0.75), less with it off, least with the weights swapped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import apatch_exact  # noqa: E402

MODEL_DIR = REPO / ".cache" / "tiny-bfcl-bpe"
GROUPS, GROUP_SIZE = 2, 8  # two GRPO groups: the batch's shape matters little, the three sequences cost the same


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seal.cpu.tiny_model import build_tiny_model

    model_dir = build_tiny_model(MODEL_DIR, shape="bfcl_bpe")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    candidates = apatch_exact.shortened(apatch_exact.load_candidates(tokenizer, model.config.model_type), 256)
    rows = ["right", "heavy", "light", "right"] * (GROUPS * GROUP_SIZE // 4)  # every group passes and fails
    start = apatch_exact.Start({k: v.clone() for k, v in model.state_dict().items()})
    return model, start, candidates, rows, apatch_exact.arm_overrides(candidates)


def run(setup, arm: str, optimizer: str, lr: float, updates: int) -> apatch_exact.ArmResult:
    model, start, candidates, rows, arms = setup
    return apatch_exact.run_arm(
        model, start, candidates, rows, GROUP_SIZE, arms[arm], optimizer, lr, updates, keep_end=True
    )


def test_apatch_with_every_weight_one_is_apatch_off_to_the_last_bit(setup):
    off, ones, on = (run(setup, arm, "adamw", 1e-4, updates=2) for arm in ("off", "ones", "on"))
    assert all(scales == {"right": 1.0, "heavy": 1.0, "light": 1.0} for scales in ones.scales)
    assert ones.metric == off.metric and ones.grad_norms == off.grad_norms
    assert all(torch.equal(ones.end.weights[k], off.end.weights[k]) for k in off.end.weights)
    moments = [(ones.end.optimizer["state"][i], state) for i, state in off.end.optimizer["state"].items()]
    assert moments and all(torch.equal(a[key], b[key]) for a, b in moments for key in b)  # AdamW's state too
    # the comparison can fail: A-Patch on scales the decoys (2.0 and ~0.75) and ends elsewhere
    assert on.scales[0]["heavy"] == 2.0 and on.scales[0]["light"] < 1.0
    assert on.metric != off.metric
    assert not all(torch.equal(on.end.weights[k], off.end.weights[k]) for k in off.end.weights)


def test_under_plain_sgd_the_decoys_scales_show_through(setup):
    change = {arm: run(setup, arm, "sgd", 0.05, updates=1) for arm in ("on", "off", "swapped")}
    on, off, swapped = (change[arm].change(1) for arm in ("on", "off", "swapped"))
    assert change["swapped"].scales[0]["heavy"] < 1.0 < change["swapped"].scales[0]["light"]
    # heavy pushed down twice as hard and light a quarter less: heavy - light falls further; swapped: less far
    assert on < off < swapped, (on, off, swapped)


def test_the_gpu_script_runs_through_reduced_on_cpu(tmp_path):
    """``scripts/apatch_exact_gpu.py --smoke``: the GPU script's code (Stage C's design, ``apatch_sampled.run_seed``,
    on a Qwen2.5-shaped model warm-started and wrapped by verl's FSDP2 in bf16, M read from an fp32 copy of its
    master weights, deterministic algorithms enforced) on CPU with a 2-layer model, a 64-token prompt, batches of 2
    groups of 8, a 1-step trunk and 2 steps an arm, so that it is known to start and run through before a GPU is
    lent: every arm of every seed ran, M is finite, each arm starts where its condition does, and the negative
    control is exact (``ones`` equals ``off`` at every step) where ``on`` does not."""
    import json
    import math
    import os
    import socket
    import subprocess

    import apatch_exact_gpu as gpu

    with socket.socket() as s:  # the one-process group's port: a free one, other runs may hold the default
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "MASTER_PORT": port, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, str(REPO / "scripts" / "apatch_exact_gpu.py"), "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads((tmp_path / "apatch_exact_gpu.json").read_text())
    assert summary["design"]["conditions"] == {"warmed": list(gpu.WARMED_ARMS)}
    assert set(summary["seeds"]) == {str(seed) for seed in gpu.SMOKE_SEEDS}
    for seed in summary["seeds"].values():
        runs = seed["conditions"]["warmed"]
        assert tuple(runs) == gpu.WARMED_ARMS  # every arm ran
        assert len(seed["trunk"]["metric"]) == gpu.SMOKE_TRUNK + 1
        assert all(len(run["metric"]) == gpu.SMOKE_ARM + 1 for run in runs.values())  # M before and after each step
        assert all(math.isfinite(m) for run in (seed["trunk"], *runs.values()) for m in run["metric"])
        assert all(run["metric"][0] == seed["trunk"]["metric"][-1] for run in runs.values())  # loaded the trunk's end
        for key in ("metric", "grad_norms", "counts"):  # the negative control, to the last bit, every step
            assert runs["ones"][key] == runs["off"][key], key
    # the control can fail: A-Patch on ends elsewhere in some seed (its batches pass and fail, its scales apply)
    assert any(seed["conditions"]["warmed"]["on"]["metric"] != seed["conditions"]["warmed"]["off"]["metric"]
               for seed in summary["seeds"].values())  # fmt: skip
    assert summary["verdict"]["negative_control"] and summary["starts_exact"] and summary["finite"]
