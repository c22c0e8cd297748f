"""The per-GPU memory estimate (``seal/launch/memory_estimate.py``) against hand-computed values and real models."""

from __future__ import annotations

from pathlib import Path

import pytest

from seal.launch import cli
from seal.launch.memory_estimate import GIB, KNOWN_SHAPES, ModelShape, estimate, model_shape
from seal.launch.recipe import compose_recipe

ROOT = Path(__file__).resolve().parents[2]
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


# Qwen2.5-7B-Instruct's config.json, by hand: hidden 3584, 28 layers, intermediate 18944, vocab 152064, 28 query heads
# and 4 key/value heads of 128, biases on q/k/v, untied embeddings; 7,615,616,512 parameters (published).
P_7B = 7_615_616_512
LAYER_7B = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584  # 233,057,792
EMBEDDING_7B = 152064 * 3584  # embed_tokens, and again lm_head: 544,997,376
TOKENS_SEAL = 8192 + 4096  # one sequence per micro-batch (ppo_micro_batch_size_per_gpu 1) at prompt + response


def test_released_recipe_rollout_on_80gb_gpus_by_hand():
    found = estimate(compose_recipe(SEAL), gpu_bytes=80 * GIB)
    assert 28 * LAYER_7B + 2 * EMBEDDING_7B + 3584 == P_7B  # the hand numbers add up to the published count
    # actor between updates: fp32 parameters (4 B) + Adam's two fp32 moments (8 B), sharded over 4 GPUs; the fp32
    # gradients (4 B) are gone: verl's train mode ends in optimizer.zero_grad(), set_to_none by default
    assert found.actor_bytes == P_7B * 12 / 4 and found.actor_host_bytes == 0
    assert found.ref_offload and found.ref_bytes == 0 and found.ref_host_bytes == P_7B * 4 / 4
    # vLLM: 0.4 x 80 GiB = 32 GiB; bf16 weights 15,231,233,024 B; 2 GiB reserve; K+V x 28 layers x 4 kv heads x 128 x 2 B
    assert found.vllm_share_bytes == 32 * GIB
    assert found.kv_cache_bytes == 32 * GIB - 15_231_233_024 - 2 * GIB
    assert found.kv_tokens == 296_125  # 16,981,021,696 B / 57,344 B per token
    # validation sends 400 tasks x 1 over 4 replicas: 100 contexts of up to 16,384 tokens each
    assert (found.busiest_phase, found.running_sequences, found.context_tokens) == ("validation", 100, 1_638_400)
    assert found.rollout_total_bytes == P_7B * 3 + 32 * GIB  # 21.3 + 32 GiB
    [warning] = found.warnings()
    assert "296,125 tokens" in warning and "1,638,400" in warning


def test_released_recipe_training_peak_on_80gb_gpus_by_hand():
    peak = estimate(compose_recipe(SEAL), gpu_bytes=80 * GIB).training
    assert peak.tokens == 12_288
    assert peak.state_bytes == P_7B * 16 / 4  # fp32 parameters + fp32 gradients + Adam, sharded: 28.4 GiB
    assert peak.ref_bytes == 0  # FSDP2 runs the forward-only reference under CPU offload
    # gradient checkpointing keeps each layer's bf16 input: 28 x 12,288 x 3584 x 2 B = 2,466,250,752 B
    assert peak.checkpointed_bytes == 2_466_250_752
    # the layer being recomputed: 4 hidden-wide (3584), 2 kv-wide (512), 3 intermediate-wide (18944) bf16 tensors per
    # token, and their gradients: 2 x 12,288 x 72,192 x 2 B
    assert peak.recomputed_layer_bytes == 2 * TOKENS_SEAL * (4 * 3584 + 2 * 512 + 3 * 18944) * 2 == 3_548_381_184
    # bf16 logits over 152,064 tokens of vocabulary and their gradient (temperature 1: no scaled copy)
    assert peak.logits_bytes == 2 * TOKENS_SEAL * 152064 * 2 == 7_474_249_728
    # lm_head (the largest unit) gathered in bf16 with the next decoder layer prefetched; lm_head's unsharded
    # gradient in bf16 and in fp32 for the reduce-scatter
    assert peak.gathered_bytes == (EMBEDDING_7B + LAYER_7B) * 2 + EMBEDDING_7B * (2 + 4) == 4_826_094_592
    assert peak.vllm_asleep and peak.vllm_bytes == 1 * GIB  # vLLM asleep: CUDA contexts only
    total = P_7B * 4 + 2_466_250_752 + 3_548_381_184 + 7_474_249_728 + 4_826_094_592 + GIB
    assert peak.total_bytes == total and round(total / GIB, 1) == 46.4


def test_the_training_peak_follows_the_token_budget_and_offload():
    base = estimate(compose_recipe(SEAL), gpu_bytes=80 * GIB).training
    dynamic = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.actor.use_dynamic_bsz=true"]), gpu_bytes=80 * GIB
    ).training
    assert dynamic.tokens == 16_384  # ppo_max_token_len_per_gpu
    assert dynamic.logits_bytes == 2 * 16_384 * 152064 * 2
    parallel = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]), gpu_bytes=80 * GIB
    ).training
    assert parallel.tokens == TOKENS_SEAL // 2 and parallel.checkpointed_bytes == base.checkpointed_bytes / 2
    kept_estimate = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.model.enable_gradient_checkpointing=false"]), gpu_bytes=80 * GIB
    )
    kept = kept_estimate.training
    # every layer keeps its activations (no recompute): 28 x 12,288 x 72,192 x 2 B
    assert kept.checkpointed_bytes == 28 * TOKENS_SEAL * 72_192 * 2 and kept.recomputed_layer_bytes == 0
    assert any("): set model.enable_gradient_checkpointing, lower" in w for w in kept_estimate.warnings())
    hot = estimate(compose_recipe(SEAL, ["actor_rollout_ref.rollout.temperature=0.7"]), gpu_bytes=80 * GIB).training
    assert hot.logits_bytes == 3 * TOKENS_SEAL * 152064 * 2  # + the temperature-scaled copy
    # offloading parameters and optimizer empties the rollout phase but not the update: verl loads them back
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
    assert offloaded.actor_bytes == 0 and offloaded.actor_host_bytes == P_7B * 12 / 4
    assert offloaded.training.state_bytes == P_7B * 16 / 4
    policy = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.actor.fsdp_config.offload_policy=true"]), gpu_bytes=80 * GIB
    )
    assert policy.actor_bytes == 0 and policy.training.state_bytes == 0


def test_a_training_peak_over_the_gpu_warns():
    long = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]), gpu_bytes=80 * GIB
    )
    assert long.training.tokens == 8 * TOKENS_SEAL
    assert any(w.startswith("the actor update needs ~") and "98,304 tokens" in w for w in long.warnings())
    assert not any("actor update" in w for w in estimate(compose_recipe(SEAL), gpu_bytes=80 * GIB).warnings())


def test_verl_frees_gradients_when_an_update_ends():
    """The rollout figure leaves gradients out because verl's engine train mode zero-grads on exit, and torch's
    zero_grad sets them to None; this pins both facts of the installed versions."""
    import torch
    from verl.workers.engine.base import BaseEngineCtx

    assert BaseEngineCtx(engine=None, mode="train").zero_grad_on_exit
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in layer.parameters())


def test_offload_and_overcommit():
    greedy = estimate(
        compose_recipe(SEAL, ["actor_rollout_ref.rollout.gpu_memory_utilization=0.9"]), gpu_bytes=80 * GIB
    )
    assert any("need ~93.3 GiB per GPU of 80.0 during rollout" in w for w in greedy.warnings())  # 21.3 actor + 72
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


def test_one_dry_run_reports_a_typo_the_disk_and_the_estimate_together(monkeypatch, capsys):
    """exp/SEAL.yaml with a misspelt key on a disk too small (its free space as the disk check reads it): the typo,
    the disk and every other problem of this CPU machine (no GPU, the hub model neither cached nor downloadable
    offline), then the memory and disk estimate, all from one dry run."""
    from seal.launch import memory_estimate

    monkeypatch.setattr(memory_estimate, "_visible_gpu_bytes", lambda: None)
    monkeypatch.setattr(memory_estimate, "free_bytes", lambda path: 50 * GIB)
    no_prompts = (
        "seal.preflight.prompt_budget=false"  # 800 prompts rendered: tests/rollout/test_prompt_budget.py's business
    )
    assert cli.main(["--conf", SEAL, "--dry-run", "+seal.apach.enable=false", no_prompts]) == 2
    out, err = capsys.readouterr()
    assert (
        "[keys] override +seal.apach.enable=false: seal.apach.enable: no such key; did you mean seal.apatch.enable?"
        in err
    )
    assert "[disk] trainer.default_local_dir" in err and "but 50.0 GiB is free there" in err
    assert "[devices]" in err and "[paths]" in err
    assert "[seal] memory per GPU (estimate): Qwen/Qwen2.5-7B-Instruct, 7.62B parameters" in out
    assert "80.0 GiB GPUs assumed (no GPU visible)" in out and "[seal] warning: the KV cache holds" in out
    assert "[seal]   rollout: 53.3 GiB of 80.0 GiB" in out
    assert "[seal]   training peak (12,288 tokens per micro-batch): 46.4 GiB of 80.0 GiB" in out
    assert "50.0 GiB free at" in out and "does NOT fit" in out
    assert len(out.splitlines()) < 40  # short: the whole config only with --full-config


# ToolACE-2-Llama-3.1-8B's config.json, by hand: 32 layers, 8 key/value heads of 128 (4096 / 32 heads), 8,030,261,248
# parameters (published); K and V of every layer in bf16: 2 x 32 x 8 x 128 x 2 B = 131,072 B a token.
KV_TOKEN_7B = 2 * 28 * 4 * 128 * 2  # 57,344 B
KV_TOKEN_8B = 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize(
    "recipe, parameters, kv_token, max_model_len",
    [("SEAL.yaml", P_7B, KV_TOKEN_7B, 16384), ("toolace2_8b.yaml", 8_030_261_248, KV_TOKEN_8B, 18432)],
)
def test_kv_capacity_against_a_steps_demand_and_the_papers_value_by_hand(
    recipe, parameters, kv_token, max_model_len, monkeypatch, capsys
):
    """What --dry-run prints of the KV cache, by hand from the model's config numbers: capacity per replica at the
    released 0.4 and at the paper's 0.6 of an 80 GiB GPU; a train step's 32 tasks x 8 rollouts over 4 replicas and
    validation's 400 tasks over 4, each up to max_model_len."""
    from seal.launch import memory_estimate

    weights = parameters * 2  # bf16, tensor parallel 1
    capacity = (int(0.4 * 80 * GIB) - weights - 2 * GIB) // kv_token
    paper_capacity = (int(0.6 * 80 * GIB) - weights - 2 * GIB) // kv_token
    found = estimate(compose_recipe(str(ROOT / "exp" / recipe)), gpu_bytes=80 * GIB)
    assert (found.kv_tokens, found.paper_kv_tokens) == (capacity, paper_capacity)
    assert found.phase_sequences == {"train step": 32 * 8 // 4, "validation": 400 // 4}
    monkeypatch.setattr(memory_estimate, "_visible_gpu_bytes", lambda: None)
    no_prompts = (
        "seal.preflight.prompt_budget=false"  # 800 prompts rendered: tests/rollout/test_prompt_budget.py's business
    )
    assert (
        cli.main(["--conf", str(ROOT / "exp" / recipe), "--dry-run", no_prompts]) == 2
    )  # no GPU: printed all the same
    out = capsys.readouterr().out
    train, val = 64 * max_model_len, 100 * max_model_len
    assert (
        f"KV cache per replica: capacity {capacity:,} tokens; demand at most: train step 64 sequences x "
        f"{max_model_len:,} = {train:,} tokens ({train / capacity:.1f}x capacity); validation 100 sequences x "
        f"{max_model_len:,} = {val:,} tokens ({val / capacity:.1f}x capacity)"
    ) in out
    rollout = (parameters * 12 / 4 + 0.6 * 80 * GIB) / GIB  # actor's fp32 parameters + Adam over 4, and vLLM's share
    assert (
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6 -> vLLM share 48.0 GiB (+16.0 GiB per GPU), KV cache "
        f"{paper_capacity:,} tokens per replica; rollout {rollout:.1f} GiB of 80.0 GiB; training peak unchanged "
        "(vLLM asleep)"
    ) in out
