"""Per-GPU memory of a recipe, estimated before a run (``launcher.py --dry-run`` prints it).

Two phases of the colocated (hybrid-engine) layout verl uses, per GPU:

* **Rollout**: the actor's parameters and Adam states sharded by FSDP over all GPUs (or offloaded to host memory),
  without gradients: verl's engine leaves its train mode with ``optimizer.zero_grad()``, whose ``set_to_none``
  default frees them after every update; the reference model (on host under FSDP2, where verl runs forward-only
  engines with ``CPUOffloadPolicy``; else sharded unless offloaded); vLLM's share, ``gpu_memory_utilization`` x GPU
  memory, of which what its weights and runtime do not take is KV cache. The KV cache's token capacity per rollout
  replica is compared with the contexts a step runs at once on that replica: its share of ``train_batch_size x n``
  (or of the validation batch) sequences, at most ``max_num_seqs`` running, each up to ``max_model_len`` tokens.
  When they do not fit, vLLM queues or preempts sequences: the rollout is slower, not wrong, so it is a warning.
* **Training peak** (the actor update, one micro-batch's backward): parameters, gradients and Adam sharded on GPU
  (verl loads offloaded parts back for the update; only ``offload_policy`` keeps them on host); the checkpointed
  activations of the micro-batch's tokens (one hidden state per layer, plus one layer recomputed in backward with
  its gradients); the logits over the vocabulary and their gradient; the FSDP units gathered at once (the largest
  unit with its unsharded gradient, and the next one prefetched); vLLM asleep (``free_cache_engine``: weights and KV
  cache released, its CUDA context kept) or its whole share.

Model size comes from the model's ``config.json`` (a local directory), else from :data:`KNOWN_SHAPES` for the
hub ids of the recipes (the same fields, copied from their config.json); anything else is not estimated.
Not modelled: vLLM's prefill activations (inside its fixed runtime reserve), the entropy term's fp32 copies
(``entropy_coeff`` is 0 in the recipes) and allocator fragmentation.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from seal.paper_numbers import GPU_MEMORY_UTILIZATION as PAPER_GPU_MEMORY_UTILIZATION
from seal.units import GIB, disk_size, gib

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}
#: Bytes per parameter of FSDP state: parameters and gradients in the model dtype, Adam's two fp32 moments.
ADAM_STATE_BYTES = 8
#: Bytes per parameter of the best checkpoint's Hugging Face export: ``verl.model_merger`` (``seal.validation
#: .export_hf``) casts every tensor to bf16 whatever the actor's ``model_dtype``.
EXPORT_BYTES_PER_PARAMETER = 2
#: vLLM memory besides weights and KV cache: the CUDA context and the activation peak of its profiling run
#: (chunked prefill of ``max_num_batched_tokens``). A rough, deliberately generous figure.
VLLM_RUNTIME_RESERVE_GIB = 2.0
#: What stays on a GPU of the sleeping vLLM and the trainer during an update: their CUDA contexts and what vLLM's
#: allocator keeps asleep. A rough figure, like the reserve above.
CUDA_CONTEXTS_GIB = 1.0
#: GPU size assumed when no GPU is visible (the released recipe's 80 GB GPUs).
ASSUMED_GPU_GIB = 80.0

#: config.json fields of the recipes' hub models, for estimates where the hub cannot be read (offline, dry-run).
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-0.5B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-3B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 11008,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "Team-ACE/ToolACE-2-Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Qwen2 / Llama family: GQA attention, gated MLP, RMSNorm)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_config(cls, cfg: dict) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        return cls(
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_width
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden + (q + 2 * kv if self.qkv_bias else 0)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + two RMSNorms

    @property
    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_parameters + embeddings + self.hidden  # + the final norm

    @property
    def largest_fsdp_unit(self) -> int:
        """Parameters of the largest unit verl's FSDP2 wrapping makes: the embeddings (with the final norm in the
        root when tied to the output layer, else a unit of their own, as is ``lm_head``), or a decoder layer."""
        return max(self.vocab * self.hidden + (self.hidden if self.tied else 0), self.layer_parameters)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # K and V of every layer


def model_shape(model_path: str) -> tuple[ModelShape, str] | None:
    """The model's shape and where it was read from; None when neither config.json nor the table has it."""
    config_json = Path(model_path) / "config.json"
    if config_json.is_file():
        cfg = json.loads(config_json.read_text())
        return ModelShape.from_config(cfg.get("text_config", cfg)), f"{config_json}"
    if model_path in KNOWN_SHAPES:
        return ModelShape.from_config(KNOWN_SHAPES[model_path]), "the known-size table (seal/launch/memory_estimate.py)"
    return None


@dataclass(frozen=True)
class TrainingPeak:
    """Per GPU during the backward of one actor micro-batch (see the module docstring for what each part is)."""

    tokens: int  # per micro-batch on one GPU
    state_bytes: float  # parameters + gradients + Adam, sharded
    ref_bytes: float
    checkpointed_bytes: float  # the layers' input hidden states (all activations without checkpointing)
    recomputed_layer_bytes: float  # one layer's activations and their gradients in backward (0 without checkpointing)
    logits_bytes: float  # logits, their gradient (and their temperature-scaled copy when temperature != 1)
    gathered_bytes: float  # unsharded FSDP units
    vllm_bytes: float
    vllm_asleep: bool
    layers: int
    vocab: int

    @property
    def total_bytes(self) -> float:
        return (
            self.state_bytes
            + self.ref_bytes
            + self.checkpointed_bytes
            + self.recomputed_layer_bytes
            + self.logits_bytes
            + self.gathered_bytes
            + self.vllm_bytes
        )

    def lines(self, gpu_bytes: float, gpus: int) -> list[str]:
        activations = (
            f"    checkpointed activations ({self.layers} layer inputs): {gib(self.checkpointed_bytes)}; "
            f"one layer recomputed in backward: {gib(self.recomputed_layer_bytes)}"
            if self.recomputed_layer_bytes
            else f"    activations of {self.layers} layers (no gradient checkpointing): {gib(self.checkpointed_bytes)}"
        )
        vllm = "asleep (weights and KV cache freed)" if self.vllm_asleep else "awake (free_cache_engine off)"
        return [
            f"  training peak ({self.tokens:,} tokens per micro-batch): {gib(self.total_bytes)} of {gib(gpu_bytes)}",
            f"    actor state (parameters + gradients + Adam, FSDP over {gpus}): {gib(self.state_bytes)}",
            *([f"    reference (on GPU): {gib(self.ref_bytes)}"] if self.ref_bytes else []),
            activations,
            f"    logits and their gradient ({self.tokens:,} x {self.vocab:,}): {gib(self.logits_bytes)}",
            f"    gathered FSDP units (largest unit + its gradient, next unit): {gib(self.gathered_bytes)}",
            f"    vLLM {vllm} and CUDA contexts: {gib(self.vllm_bytes)}",
        ]


@dataclass(frozen=True)
class MemoryEstimate:
    model: str
    source: str
    parameters: int
    gpus: int
    gpu_bytes: float
    gpu_assumed: bool
    actor_bytes: float  # per GPU during rollout: params + Adam, sharded (0 for what is offloaded); no gradients
    actor_host_bytes: float  # per GPU, offloaded parts
    actor_dtype: str
    ref_bytes: float
    ref_host_bytes: float
    ref_offload: bool
    vllm_share_bytes: float
    vllm_weight_bytes: float
    kv_cache_bytes: float
    kv_tokens: int  # per rollout replica
    replicas: int
    tensor_parallel: int
    running_sequences: int  # per replica, at once
    sequences_per_replica: int
    context_tokens: int  # running_sequences x max_model_len
    max_model_len: int
    busiest_phase: str
    training: TrainingPeak
    kv_bytes_per_token: int  # K and V of every layer, all tensor-parallel ranks together
    phase_sequences: dict[str, int]  # {"train step" | "validation": sequences per replica}
    max_num_seqs: int
    gpu_memory_utilization: float
    paper_kv_tokens: int  # per replica at the paper's gpu_memory_utilization

    @property
    def paper_share_bytes(self) -> float:
        return PAPER_GPU_MEMORY_UTILIZATION * self.gpu_bytes

    @property
    def rollout_total_bytes(self) -> float:
        return self.actor_bytes + self.ref_bytes + self.vllm_share_bytes

    def lines(self) -> list[str]:
        gpu = f"{gib(self.gpu_bytes)} GPUs" + (" assumed (no GPU visible)" if self.gpu_assumed else "")
        ref_place = "offloaded to host memory" if self.ref_offload else "on GPU"
        return [
            f"memory per GPU (estimate): {self.model}, {self.parameters / 1e9:.2f}B parameters from {self.source}; "
            f"{self.gpus} x {gpu}",
            f"  rollout: {gib(self.rollout_total_bytes)} of {gib(self.gpu_bytes)}",
            f"    actor ({self.actor_dtype} parameters + Adam, FSDP over {self.gpus}; gradients freed after each "
            f"update): {gib(self.actor_bytes)}"
            + (f" (+ {gib(self.actor_host_bytes)} offloaded to host)" if self.actor_host_bytes else ""),
            f"    reference ({ref_place}): {gib(self.ref_bytes)}"
            + (f" (+ {gib(self.ref_host_bytes)} on host)" if self.ref_offload else ""),
            f"    vLLM share: {gib(self.vllm_share_bytes)} = weights {gib(self.vllm_weight_bytes)} + runtime "
            f"reserve {VLLM_RUNTIME_RESERVE_GIB:.1f} GiB + KV cache {gib(self.kv_cache_bytes)} "
            f"-> {self.kv_tokens:,} tokens per replica ({self.replicas} replicas x TP {self.tensor_parallel})",
            f"    contexts at once ({self.busiest_phase}): {self.running_sequences} of {self.sequences_per_replica} "
            f"sequences per replica x max_model_len {self.max_model_len} = {self.context_tokens:,} tokens",
            *self.kv_lines(),
            *self.training.lines(self.gpu_bytes, self.gpus),
        ]

    def kv_lines(self) -> list[str]:
        """The KV cache's capacity against what each phase asks of it, and the override that restores the paper's
        gpu_memory_utilization with what it costs."""
        demand = "; ".join(
            f"{phase} {n} sequences x {self.max_model_len:,} = {min(n, self.max_num_seqs) * self.max_model_len:,} "
            f"tokens ({min(n, self.max_num_seqs) * self.max_model_len / max(self.kv_tokens, 1):.1f}x capacity)"
            for phase, n in self.phase_sequences.items()
        )
        lines = [f"  KV cache per replica: capacity {self.kv_tokens:,} tokens; demand at most: {demand}"]
        if self.gpu_memory_utilization != PAPER_GPU_MEMORY_UTILIZATION:
            extra = self.paper_share_bytes - self.vllm_share_bytes
            rollout = self.rollout_total_bytes + extra
            training = "unchanged (vLLM asleep)" if self.training.vllm_asleep else f"+{gib(extra)}"
            lines.append(
                f"  the paper's value (its hyperparameter table; the released recipe has {self.gpu_memory_utilization}): "
                f"actor_rollout_ref.rollout.gpu_memory_utilization={PAPER_GPU_MEMORY_UTILIZATION} -> vLLM share "
                f"{gib(self.paper_share_bytes)} ({'+' if extra >= 0 else ''}{gib(extra)} per GPU), KV cache "
                f"{self.paper_kv_tokens:,} tokens per replica; rollout {gib(rollout)} of {gib(self.gpu_bytes)}; "
                f"training peak {training}"
            )
        return lines

    def warnings(self) -> list[str]:
        out = []
        if self.kv_cache_bytes <= 0:
            out.append(
                f"vLLM's share ({self.vllm_share_bytes / GIB:.1f} GiB) does not hold its weights and runtime: raise "
                "actor_rollout_ref.rollout.gpu_memory_utilization or tensor_model_parallel_size"
            )
        elif self.kv_tokens < self.context_tokens:
            out.append(
                f"the KV cache holds ~{self.kv_tokens:,} tokens per rollout replica but the {self.busiest_phase} runs "
                f"{self.running_sequences} contexts of up to {self.max_model_len} tokens there ({self.context_tokens:,}): "
                "vLLM will queue or preempt sequences (slower rollouts); raise rollout.gpu_memory_utilization, lower "
                "rollout.max_num_seqs or rollout.max_model_len"
            )
        if self.rollout_total_bytes > self.gpu_bytes:
            out.append(
                f"actor, reference and vLLM together need ~{self.rollout_total_bytes / GIB:.1f} GiB per GPU of "
                f"{self.gpu_bytes / GIB:.1f} during rollout: offload (actor.fsdp_config.param_offload / "
                "optimizer_offload, ref.fsdp_config.param_offload) or lower rollout.gpu_memory_utilization"
            )
        if self.training.total_bytes > self.gpu_bytes:
            checkpointing = "" if self.training.recomputed_layer_bytes else "set model.enable_gradient_checkpointing, "
            out.append(
                f"the actor update needs ~{self.training.total_bytes / GIB:.1f} GiB per GPU of "
                f"{self.gpu_bytes / GIB:.1f} ({self.training.tokens:,} tokens per micro-batch): {checkpointing}lower "
                "actor.ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu with use_dynamic_bsz), raise "
                "actor.ulysses_sequence_parallel_size or the GPU count, or set actor.fsdp_config.offload_policy=true "
                "(param_offload and optimizer_offload do not help here: verl loads both back for the update)"
            )
        return out


def estimate(config, gpu_bytes: float | None = None) -> MemoryEstimate | None:
    """The estimate for a composed recipe; None when the model's size is unknown. ``gpu_bytes``: memory of one
    GPU (None: the visible GPU's, else :data:`ASSUMED_GPU_GIB`)."""
    aro = config.actor_rollout_ref
    found = model_shape(str(aro.model.path))
    if found is None:
        return None
    shape, source = found
    gpu_assumed = False
    if gpu_bytes is None:
        gpu_bytes, gpu_assumed = _visible_gpu_bytes(), False
        if gpu_bytes is None:
            gpu_bytes, gpu_assumed = ASSUMED_GPU_GIB * GIB, True
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    params = shape.parameters
    actor_cfg = aro.actor.fsdp_config
    actor_dtype = str(actor_cfg.get("model_dtype") or "fp32")
    weights = params * DTYPE_BYTES[actor_dtype] / gpus
    optimizer = params * ADAM_STATE_BYTES / gpus
    all_on_host = bool(actor_cfg.get("offload_policy"))  # FSDP2's CPUOffloadPolicy: state and optimizer step on host
    on_gpu = (
        0
        if all_on_host
        else (0 if actor_cfg.param_offload else weights) + (0 if actor_cfg.optimizer_offload else optimizer)
    )
    ref_cfg = aro.ref.fsdp_config
    ref_shard = params * DTYPE_BYTES[str(ref_cfg.get("model_dtype") or "fp32")] / gpus
    ref_offload = bool(ref_cfg.param_offload) or str(aro.ref.get("strategy") or aro.actor.strategy) == "fsdp2"
    rollout = aro.rollout
    tp = int(rollout.tensor_model_parallel_size)
    share = float(rollout.gpu_memory_utilization) * gpu_bytes
    vllm_weights = params * DTYPE_BYTES[str(rollout.dtype)] / tp
    kv_bytes = share - vllm_weights - VLLM_RUNTIME_RESERVE_GIB * GIB
    replicas = max(gpus // tp, 1)
    per_token = shape.kv_bytes_per_token(DTYPE_BYTES[str(rollout.dtype)])
    kv_tokens = max(int(kv_bytes * tp // per_token), 0)
    paper_kv = PAPER_GPU_MEMORY_UTILIZATION * gpu_bytes - vllm_weights - VLLM_RUNTIME_RESERVE_GIB * GIB
    phases = _phase_sequences(config, replicas)
    phase, per_replica = max(phases.items(), key=lambda item: item[1])
    running = min(per_replica, int(rollout.max_num_seqs))
    max_model_len = int(rollout.max_model_len or int(rollout.prompt_length) + int(rollout.response_length))
    ref_on_gpu = 0 if ref_offload else ref_shard
    return MemoryEstimate(
        model=str(aro.model.path),
        source=source,
        parameters=params,
        gpus=gpus,
        gpu_bytes=gpu_bytes,
        gpu_assumed=gpu_assumed,
        actor_bytes=on_gpu,
        actor_host_bytes=weights + optimizer - on_gpu,
        actor_dtype=actor_dtype,
        ref_bytes=ref_on_gpu,
        ref_host_bytes=ref_shard,
        ref_offload=ref_offload,
        vllm_share_bytes=share,
        vllm_weight_bytes=vllm_weights,
        kv_cache_bytes=kv_bytes,
        kv_tokens=kv_tokens,
        replicas=replicas,
        tensor_parallel=tp,
        running_sequences=running,
        sequences_per_replica=per_replica,
        context_tokens=running * max_model_len,
        max_model_len=max_model_len,
        busiest_phase=phase,
        training=_training_peak(
            config,
            shape,
            state_bytes=0 if all_on_host else 2 * weights + optimizer,
            ref_bytes=ref_on_gpu,
            vllm_share_bytes=share,
        ),
        kv_bytes_per_token=per_token,
        phase_sequences=phases,
        max_num_seqs=int(rollout.max_num_seqs),
        gpu_memory_utilization=float(rollout.gpu_memory_utilization),
        paper_kv_tokens=max(int(paper_kv * tp // per_token), 0),
    )


def _training_peak(config, shape: ModelShape, state_bytes: float, ref_bytes: float, vllm_share_bytes: float):
    aro = config.actor_rollout_ref
    precision = aro.actor.fsdp_config.get("mixed_precision") or {}
    compute = DTYPE_BYTES[str(precision.get("param_dtype", "bf16"))]  # FSDP's mixed precision: bf16 by default
    reduce = DTYPE_BYTES[str(precision.get("reduce_dtype", "fp32"))]
    tokens = _micro_batch_tokens(config)
    # one decoder layer's activations: both norm outputs, q and the attention output (hidden wide), k and v (kv
    # wide), the MLP's gate, up and gated product (intermediate wide)
    layer_activations = tokens * (4 * shape.hidden + 2 * shape.kv_width + 3 * shape.intermediate) * compute
    checkpointing = bool(aro.model.get("enable_gradient_checkpointing"))
    if checkpointing:  # each layer keeps its input; backward recomputes one layer at a time, with its gradients
        kept, recomputed = shape.layers * tokens * shape.hidden * compute, 2 * layer_activations
    else:
        kept, recomputed = shape.layers * layer_activations, 0
    # verl scales the logits by the temperature in place of a copy only at temperature 1
    logits_copies = 2 if float(aro.rollout.temperature) == 1.0 else 3
    largest = shape.largest_fsdp_unit
    asleep = bool(aro.rollout.free_cache_engine)
    return TrainingPeak(
        tokens=tokens,
        state_bytes=state_bytes,
        ref_bytes=ref_bytes,
        checkpointed_bytes=kept,
        recomputed_layer_bytes=recomputed,
        logits_bytes=logits_copies * tokens * shape.vocab * compute,
        # gathered in the compute dtype with the unit prefetched after it; its unsharded gradient in the compute
        # dtype and again in the reduce dtype for the reduce-scatter
        gathered_bytes=(largest + shape.layer_parameters) * compute + largest * (compute + reduce),
        vllm_bytes=CUDA_CONTEXTS_GIB * GIB + (0 if asleep else vllm_share_bytes),
        vllm_asleep=asleep,
        layers=shape.layers,
        vocab=shape.vocab,
    )


def _micro_batch_tokens(config) -> int:
    """Tokens one GPU runs through the actor at once: the dynamic batch's budget, else the micro-batch's
    sequences at their longest (prompt + response), split over the sequence-parallel group."""
    aro = config.actor_rollout_ref
    actor = aro.actor
    if actor.use_dynamic_bsz:
        return int(actor.ppo_max_token_len_per_gpu)
    sequence = int(aro.rollout.prompt_length) + int(aro.rollout.response_length)
    parallel = int(actor.get("ulysses_sequence_parallel_size") or 1)
    return math.ceil(int(actor.ppo_micro_batch_size_per_gpu) * sequence / parallel)


def _phase_sequences(config, replicas: int) -> dict[str, int]:
    """{phase: sequences per rollout replica} of a train step and of a validation batch (the busier one's warning)."""
    rollout = config.actor_rollout_ref.rollout
    train = int(config.data.train_batch_size) * int(rollout.n)
    val_batch = config.data.get("val_batch_size") or data_rows(config.data.val_files)  # null: the whole set at once
    val = int(val_batch) * int(rollout.val_kwargs.n)
    return {"train step": math.ceil(train / replicas), "validation": math.ceil(val / replicas)}


def data_rows(files, root: str | Path = ".") -> int:
    """Rows of a recipe's data file(s) (one path or a list; relative ones under ``root``; missing ones count 0)."""
    import pyarrow.parquet as pq

    paths = [Path(root, f) for f in ([files] if isinstance(files, str) else list(files))]
    return sum(pq.ParquetFile(path).metadata.num_rows for path in paths if path.is_file())


def _visible_gpu_bytes() -> float | None:
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        return None
    return None


# ---- disk ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointDisk:
    """Disk a recipe's checkpoints take at their peak under ``trainer.default_local_dir``."""

    parameters: int
    checkpoint_bytes: int  # one step checkpoint: what actor.checkpoint.save_contents names
    at_once: int  # step checkpoints on disk at once, at most
    export_bytes: int  # the best checkpoint's Hugging Face export at the end (0: none)

    @property
    def total_bytes(self) -> int:
        return self.at_once * self.checkpoint_bytes + self.export_bytes

    def describe(self) -> str:
        export = f" + a Hugging Face export of {disk_size(self.export_bytes)}" if self.export_bytes else ""
        return (
            f"{self.at_once} checkpoint(s) of {disk_size(self.checkpoint_bytes)} ({_count(self.parameters)} "
            f"parameters){export} = {disk_size(self.total_bytes)}"
        )


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.2f}M"


def checkpoint_disk(config) -> CheckpointDisk | None:
    """The peak disk use of the recipe's checkpoints; None when the model's size is unknown (see ``estimate``).

    Per parameter, a checkpoint holds the actor's weights in its ``model_dtype`` (``model``), Adam's two fp32
    moments (``optimizer``) and a Hugging Face copy (``hf_model``: verl's checkpoint manager saves the gathered
    weights as they are, in ``model_dtype``); ``extra`` (scheduler, RNG) is negligible. The best checkpoint's export
    is bf16 (:data:`EXPORT_BYTES_PER_PARAMETER`).
    """
    aro = config.actor_rollout_ref
    found = model_shape(str(aro.model.path))
    if found is None:
        return None
    params = found[0].parameters
    weight_bytes = DTYPE_BYTES[str(aro.actor.fsdp_config.get("model_dtype") or "fp32")]
    contents = set(aro.actor.checkpoint.get("save_contents") or ())
    per_parameter = weight_bytes * (("model" in contents) + ("hf_model" in contents)) + ADAM_STATE_BYTES * (
        "optimizer" in contents
    )
    best = config.seal.checkpoint
    exported = bool(best.save_best and best.export_hf)
    return CheckpointDisk(
        parameters=params,
        checkpoint_bytes=params * per_parameter,
        at_once=checkpoints_at_once(config),
        export_bytes=params * EXPORT_BYTES_PER_PARAMETER if exported else 0,
    )


def checkpoints_at_once(config) -> int:
    """Step checkpoints on disk at once, at most. With ``keep_only_best`` every save prunes to the best and the
    latest (``seal.validation.BestCheckpoint.prune``), after the new one is written: 3 while periodic saves
    (``trainer.save_freq``) write next to a best that is not the latest, 2 when only a new best is saved. verl's
    ``max_actor_ckpt_to_keep`` removes old ones before it writes; otherwise every save stays. An evaluation
    (``trainer.val_only``) writes none."""
    trainer, best = config.trainer, config.seal.checkpoint
    periodic = int(trainer.save_freq or 0) > 0
    if trainer.get("val_only") or (not periodic and not best.save_best):
        return 0
    if best.save_best and best.keep_only_best:
        return 3 if periodic else 2
    if trainer.get("max_actor_ckpt_to_keep"):
        return int(trainer.max_actor_ckpt_to_keep)
    steps = training_steps(config)
    saves = math.ceil(steps / int(trainer.save_freq)) if periodic else 0
    if best.save_best and int(trainer.test_freq or 0) > 0:
        saves += math.ceil(steps / int(trainer.test_freq))
    return max(saves, 1)


def training_steps(config, root: str | Path = ".") -> int:
    """The run's steps: ``trainer.total_training_steps``, else epochs x the full batches of the train file(s)
    (verl drops the last, partial one); relative data paths under ``root``."""
    steps = config.trainer.get("total_training_steps")
    if steps:
        return int(steps)
    per_epoch = data_rows(config.data.train_files, root) // int(config.data.train_batch_size)
    return max(per_epoch, 1) * int(config.trainer.total_epochs)


@dataclass(frozen=True)
class CheckpointRoom:
    """The disk a recipe's checkpoints take at their peak (:func:`checkpoint_disk`) and the room for
    them at ``trainer.default_local_dir``: its free space, and what is already there (a resumed run's checkpoints
    are among those it keeps)."""

    disk: CheckpointDisk
    root: Path
    present_bytes: int
    free_bytes: int

    @property
    def fits(self) -> bool:
        return self.disk.total_bytes - self.present_bytes <= self.free_bytes


def checkpoint_room(config) -> CheckpointRoom | None:
    """None for a model of unknown size (not estimated) or a recipe that writes no checkpoint."""
    disk = checkpoint_disk(config)
    if disk is None or not disk.total_bytes:
        return None
    root = Path(str(config.trainer.default_local_dir)).absolute()
    existing = root
    while not existing.exists():
        existing = existing.parent
    present = sum(  # not through links: the `best` link is a checkpoint counted once
        os.lstat(os.path.join(folder, name)).st_size for folder, _, names in os.walk(root) for name in names
    )
    return CheckpointRoom(disk, root, present, free_bytes(existing))


def free_bytes(path: Path) -> int:
    """Free space of the file system holding ``path``."""
    return shutil.disk_usage(path).free
