"""The per-GPU memory estimate (``seal/memory_estimate.py``) against hand-computed values and real models."""

from __future__ import annotations

from pathlib import Path

import pytest

from seal import launch
from seal.launch import compose_recipe
from seal.memory_estimate import GIB, KNOWN_SHAPES, ModelShape, estimate, model_shape

ROOT = Path(__file__).resolve().parents[1]
SEAL = str(ROOT / "exp" / "SEAL.yaml")

# Published parameter counts of the models (their model cards / safetensors index).
PUBLISHED_PARAMETERS = {
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Team-ACE/ToolACE-2-Llama-3.1-8B": 8_030_261_248,  # Llama-3.1-8B
}


@pytest.mark.parametrize("model", sorted(PUBLISHED_PARAMETERS))
def test_parameter_count_matches_the_published_one(model):
    assert ModelShape.from_config(KNOWN_SHAPES[model]).parameters == PUBLISHED_PARAMETERS[model]


def test_a_local_model_is_read_from_its_config_json(tiny_dir):
    from transformers import AutoModelForCausalLM

    shape, source = model_shape(str(tiny_dir))
    assert source.endswith("config.json")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert shape.parameters == sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def test_released_recipe_on_80gb_gpus_by_hand():
    found = estimate(compose_recipe(SEAL), gpu_bytes=80 * GIB)
    params = 7_615_616_512
    # actor: fp32 parameters (4 B) + fp32 gradients (4 B) + Adam's two fp32 moments (8 B), sharded over 4 GPUs
    assert found.actor_bytes == params * 16 / 4
    assert found.ref_offload and found.ref_bytes == 0 and found.ref_host_bytes == params * 4 / 4
    # vLLM: 0.4 x 80 GiB = 32 GiB; bf16 weights 15,231,233,024 B; 2 GiB reserve; K+V x 28 layers x 4 kv heads x 128 x 2 B
    assert found.vllm_share_bytes == 32 * GIB
    assert found.kv_cache_bytes == 32 * GIB - 15_231_233_024 - 2 * GIB
    assert found.kv_tokens == 296_125  # 16,981,021,696 B / 57,344 B per token
    # validation sends 400 tasks x 1 over 4 replicas: 100 contexts of up to 16,384 tokens each
    assert (found.busiest_phase, found.running_sequences, found.context_tokens) == ("validation", 100, 1_638_400)
    [warning] = found.warnings()
    assert "296,125 tokens" in warning and "1,638,400" in warning


def test_offload_and_overcommit():
    offloaded = estimate(
        compose_recipe(
            SEAL,
            [
                "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            ],
        ),
        gpu_bytes=80 * GIB,
    )
    assert offloaded.actor_bytes == 0 and offloaded.actor_host_bytes == 7_615_616_512 * 16 / 4
    greedy = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.9"]), gpu_bytes=80 * GIB
    )
    assert any("need ~100.4 GiB per GPU of 80.0" in w for w in greedy.warnings())  # 28.4 actor + 72 vLLM
    starved = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.1"]), gpu_bytes=80 * GIB
    )
    assert starved.kv_tokens == 0 and "does not hold its weights" in starved.warnings()[0]


def test_fewer_sequences_fit_quietly():
    small = estimate(
        compose_recipe(
            SEAL,
            [
                "data.val_batch_size=32",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.rollout.max_model_len=8192",
                "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
            ],
        ),
        gpu_bytes=80 * GIB,
    )
    assert small.running_sequences == 16 and small.context_tokens == 16 * 8192 < small.kv_tokens
    assert small.warnings() == []


def test_a_null_validation_batch_sends_the_whole_validation_set_at_once(monkeypatch):
    monkeypatch.chdir(ROOT)
    found = estimate(compose_recipe(str(ROOT / "exp" / "gpu_smoke.yaml")), gpu_bytes=80 * GIB)
    assert found.busiest_phase == "train step" and found.running_sequences == 4 * 4  # 8 validation tasks x 1
    everything = estimate(compose_recipe(SEAL, ["data.val_batch_size=null"]), gpu_bytes=80 * GIB)
    assert (everything.busiest_phase, everything.running_sequences) == ("validation", 100)  # 400 tasks / 4 replicas


def test_unknown_hub_model_is_not_estimated():
    assert estimate(compose_recipe(SEAL, ["actor_rollout_ref.model.path=some-org/some-model"])) is None


def test_dry_run_prints_the_estimate(monkeypatch, capsys):
    from seal import memory_estimate

    monkeypatch.setattr(launch, "preflight", lambda config: [])  # no GPUs here: the node checks would refuse
    monkeypatch.setattr(memory_estimate, "_visible_gpu_bytes", lambda: None)
    assert launch.main(["--conf", SEAL, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[seal] memory per GPU (estimate): Qwen/Qwen2.5-7B-Instruct, 7.62B parameters" in out
    assert "80.0 GiB GPUs assumed (no GPU visible)" in out and "[seal] warning: the KV cache holds" in out
