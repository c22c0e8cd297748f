"""CPU rollout backend ``hf``: HF ``generate`` behind verl's rollout-server interface.

On GPU verl rolls out through vLLM; verl 0.9.1 ships no usable CPU backend (its ``HFRollout`` is
not a server and is not registered). This module provides the three pieces verl's agent-loop
rollout expects, so the unchanged ``RayPPOTrainer`` runs on CPU:

* :class:`HFRolloutServer` -- the token-in/token-out server (a Ray actor in training, a plain
  object in tests). ``generate(prompt_ids, sampling_params)`` returns a ``TokenOutput`` with the
  sampled ids, their log-probs and a stop reason, following vLLM's semantics as verl uses them
  (temperature 0 = greedy, server-side ``max_tokens`` default, EOS + ``stop_token_ids``).
* :class:`HFRolloutReplica` -- the ``RolloutReplica`` the trainer's ``LLMServerManager`` creates
  (hybrid mode): launches one named server actor per replica.
* :class:`HFRolloutAdapter` -- the ``BaseRollout`` living in each training worker: on weight
  sync it drains the per-tensor generator on every rank (with FSDP2 each item is a collective)
  and the replica leader loads the tensors into its server actor.

Generation is one request at a time per server (a lock around ``generate``): simple, exact, and
fast enough for tiny CPU models; batching is the obvious next step if rollouts get longer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"

# vLLM treats temperatures below this as greedy; we do the same.
_GREEDY_EPS = 1e-5

# Sampling keys we implement, and keys that are harmless to ignore (detokenization options: this
# server returns token ids only). Anything else is rejected rather than silently ignored.
_SUPPORTED_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "max_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "seed",
    "do_sample",
    "n",
}
_IGNORED_KEYS = {"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "include_stop_str_in_output"}


def server_actor_name(replica_rank: int, role: str = "", suffix: str = "") -> str:
    """Ray actor name shared by the replica (creates it) and the adapters (look it up).

    The policy rollout uses the plain name (its adapters know only their rank); reward/teacher
    replicas, which have no adapter, get a role prefix so they cannot collide with it."""
    role = f"{role}_" if role else ""
    return f"seal_hf_rollout_{role}server_{replica_rank}{suffix}"


# ---------------------------------------------------------------------------------------------
# Server
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFServerConfig:
    """The subset of verl's RolloutConfig the server needs (plain values, easy to build in tests)."""

    prompt_length: int = 512
    response_length: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings (as vLLM)
    dtype: str = "float32"
    logprobs_mode: str = "processed_logprobs"  # or "raw_logprobs"
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    seed: int = 42

    @classmethod
    def from_rollout_config(cls, config: Any) -> HFServerConfig:
        """Pick our fields from a RolloutConfig / DictConfig / dict (missing ones keep defaults)."""
        getter = config.get if hasattr(config, "get") else lambda key, default: getattr(config, key, default)
        values = {}
        for f in fields(cls):
            value = getter(f.name, None)
            if value is not None:
                values[f.name] = value
        return cls(**values)


def _torch_dtype(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    return getattr(torch, aliases.get(name, name))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class HFRolloutServer:
    """Token-in/token-out generation server over a HF causal LM (CPU)."""

    def __init__(
        self,
        model_path: str,
        config: HFServerConfig | Any = None,
        replica_rank: int = 0,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.config = config if isinstance(config, HFServerConfig) else HFServerConfig.from_rollout_config(config or {})
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=_torch_dtype(self.config.dtype),
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        ).eval()
        self.model.requires_grad_(False)
        self.eos_ids, self.pad_id = self._special_ids()
        self._neutralize_generation_defaults()
        self.max_model_len = self.config.max_model_len or self.model.config.max_position_embeddings
        self._lock = threading.Lock()  # one generate / weight load at a time
        torch.manual_seed(self.config.seed + replica_rank)

    def _special_ids(self) -> tuple[list[int], int]:
        """EOS ids as vLLM sees them: the generation config's list plus the model config's id."""
        gen_cfg, cfg = self.model.generation_config, self.model.config
        eos = sorted(set(_as_id_list(gen_cfg.eos_token_id)) | set(_as_id_list(cfg.eos_token_id)))
        pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else cfg.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        return eos, int(pad)

    def _neutralize_generation_defaults(self) -> None:
        # HF `generate` fills every unset field from the checkpoint's generation_config.json (real
        # Qwen checkpoints ship top_k=20, temperature=0.7, ...). Sampling must follow the request
        # alone, as in vLLM, so drop those defaults; each request sets what it needs.
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()

    # ---- generation ------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str | None = None,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """verl's server entry point (called by LLMServerClient.generate); runs off the event loop."""
        if image_data or video_data or kwargs.get("audio_data"):
            raise NotImplementedError("the hf rollout backend is text-only")
        return await asyncio.to_thread(self.generate_tokens, prompt_ids, sampling_params)

    def generate_tokens(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """Blocking generation of one request."""
        params = dict(sampling_params or {})
        _check_sampling_keys(params)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), params)
        want_logprobs = bool(params.get("logprobs", False))
        gen_config = self._generation_config(params, max_tokens, want_logprobs)
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with self._lock, torch.inference_mode():
            if params.get("seed") is not None:
                torch.manual_seed(int(params["seed"]))
            out = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_config
            )
        token_ids = out.sequences[0, input_ids.shape[1] :].tolist()
        log_probs = self._sampled_logprobs(out, token_ids) if want_logprobs else None
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

    def resolve_max_tokens(self, prompt_len: int, params: dict[str, Any]) -> int:
        """The request's max_tokens/max_new_tokens, else vLLM-in-verl's default; capped by max_model_len."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room within max_model_len={self.max_model_len}")
        if params.get("max_tokens") is not None:
            wanted = int(params["max_tokens"])
        elif params.get("max_new_tokens") is not None:
            wanted = int(params["max_new_tokens"])
        else:
            # same default as verl's vLLM server: a full response, but within the prompt+response budget
            cfg = self.config
            wanted = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        return max(1, min(wanted, room))

    def _generation_config(self, params: dict[str, Any], max_tokens: int, want_logprobs: bool):
        from transformers import GenerationConfig

        temperature = float(params.get("temperature", 1.0))
        greedy = temperature < _GREEDY_EPS or params.get("do_sample") is False
        top_k = int(params.get("top_k", -1) or -1)
        ignore_eos = bool(params.get("ignore_eos", self.config.ignore_eos))
        stop_ids = set(_as_id_list(params.get("stop_token_ids")))
        if not ignore_eos:
            stop_ids |= set(self.eos_ids)
        # Greedy leaves the sampling knobs unset (HF warns about them otherwise; they are unused).
        sampling = (
            {}
            if greedy
            else {
                "temperature": temperature,
                "top_k": top_k if top_k > 0 else 0,  # HF: 0 disables top-k (unset would mean 50)
                "top_p": float(params.get("top_p", 1.0)),
                "min_p": float(params["min_p"]) if params.get("min_p") else None,
            }
        )
        return GenerationConfig(
            do_sample=not greedy,
            **sampling,
            repetition_penalty=float(params.get("repetition_penalty", self.config.repetition_penalty)),
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=self.pad_id,
            num_beams=1,
            use_cache=True,
            return_dict_in_generate=True,
            output_scores=want_logprobs and self.config.logprobs_mode != "raw_logprobs",
            output_logits=want_logprobs and self.config.logprobs_mode == "raw_logprobs",
        )

    def _sampled_logprobs(self, out: Any, token_ids: list[int]) -> list[float]:
        """Log-prob of each generated token.

        processed_logprobs (verl's default): after temperature / top-k / top-p -- the distribution
        the token was actually drawn from, like vLLM. raw_logprobs: the model's plain softmax.
        """
        steps = out.logits if self.config.logprobs_mode == "raw_logprobs" else out.scores
        return [
            float(torch.log_softmax(step[0].float(), dim=-1)[token].item()) for step, token in zip(steps, token_ids)
        ]

    # ---- weights -----------------------------------------------------------------------------

    async def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict:
        """Replace the model weights (called by the leader adapter after each actor update)."""
        return await asyncio.to_thread(self.load_state_dict, weights)

    def load_state_dict(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict:
        named = dict(weights.items() if isinstance(weights, dict) else weights)
        with self._lock:
            result = self.model.load_state_dict(named, strict=False)
        missing = [k for k in result.missing_keys if not self._is_tied_key(k)]
        if missing or result.unexpected_keys:
            # A name mismatch would silently leave the rollout on stale weights: fail instead.
            raise ValueError(f"weight sync mismatch: missing={missing[:5]} unexpected={result.unexpected_keys[:5]}")
        return {"loaded": len(named)}

    def _is_tied_key(self, key: str) -> bool:
        return key == "lm_head.weight" and bool(getattr(self.model.config, "tie_word_embeddings", False))

    # ---- lifecycle: RolloutReplica forwards these to every server; nothing to do on CPU ---------

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def ready(self) -> bool:
        return True

    async def wake_up(self, tags: list[str] | None = None, **kwargs: Any) -> None:
        return None

    async def sleep(self, **kwargs: Any) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict:
        return {}  # requests are short and serial; nothing is in flight long enough to abort

    async def resume_generation(self, **kwargs: Any) -> None:
        return None

    async def clear_kv_cache(self, **kwargs: Any) -> None:
        return None

    async def release_kv_cache(self, **kwargs: Any) -> None:
        return None

    async def resume_kv_cache(self, **kwargs: Any) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self, **kwargs: Any) -> None:
        return None


def _check_sampling_keys(params: dict[str, Any]) -> None:
    unknown = set(params) - _SUPPORTED_KEYS - _IGNORED_KEYS
    if unknown:
        raise ValueError(f"hf rollout: unsupported sampling params {sorted(unknown)}")
    if int(params.get("n", 1)) != 1:
        raise ValueError("hf rollout: n must be 1 (verl repeats prompts itself)")


# ---------------------------------------------------------------------------------------------
# Replica (driver / TaskRunner side)
# ---------------------------------------------------------------------------------------------


def _model_path(model_config: Any) -> str:
    """Local model dir from the raw `actor_rollout_ref.model` config (or an HFModelConfig)."""
    from verl.utils.fs import copy_to_local

    local = getattr(model_config, "local_path", None)
    return local or copy_to_local(model_config.path)


class HFRolloutReplica(RolloutReplica):
    """One HF generation server per replica; in hybrid mode it sits next to the trainer workers."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self):
        import ray

        role = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""
        name = server_actor_name(self.replica_rank, role, self.name_suffix)
        server_cls = ray.remote(HFRolloutServer)
        # num_cpus=0: the trainer's placement bundles already hold the logical CPUs; the server only
        # runs while the trainer waits for rollouts.
        server = server_cls.options(name=name, num_cpus=0, max_concurrency=self.max_concurrency).remote(
            model_path=_model_path(self.model_config),
            config=HFServerConfig.from_rollout_config(self.config),
            replica_rank=self.replica_rank,
            trust_remote_code=bool(_get(self.model_config, "trust_remote_code", False)),
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name  # only a unique load-balancer key; there is no HTTP endpoint


def _get(config: Any, key: str, default: Any) -> Any:
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


# ---------------------------------------------------------------------------------------------
# Adapter (inside each training worker)
# ---------------------------------------------------------------------------------------------


def drain_named_tensors(weights: Iterable[tuple[str, torch.Tensor]], keep: bool) -> dict[str, torch.Tensor] | None:
    """Consume the whole weight generator; keep compact CPU copies only if `keep`.

    Every rank must drain it: with FSDP2 each item is produced by a collective (full_tensor).
    The copy makes each tensor own its storage, so Ray pickles just that tensor (not a larger
    flat buffer it might view) and later optimizer steps cannot alias what was sent.
    """
    kept: dict[str, torch.Tensor] | None = {} if keep else None
    for name, tensor in weights:
        if kept is not None:
            kept[name] = tensor.detach().to("cpu").clone()
    return kept


class HFRolloutAdapter(BaseRollout):
    """verl's per-worker rollout handle: forwards weight syncs to this replica's server actor."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any = None, *args: Any, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        replica_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // replica_size
        self.is_leader = rank % replica_size == 0
        self._server = None

    def _server_handle(self):
        # Looked up lazily: the replica launches the server after the workers are built.
        if self._server is None:
            import ray

            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None  # CPU memory is never released, so there is nothing to bring back

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs: Any):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout supports only named_tensors weight sync, got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("hf rollout: LoRA adapter sync is not supported (use lora.merge=True)")
        state = drain_named_tensors(weights, keep=self.is_leader)
        if not self.is_leader:
            return
        server = self._server_handle()
        await server.load_weights.remote(state)
        if kwargs.get("global_steps") is not None:
            await server.set_global_steps.remote(kwargs["global_steps"])
