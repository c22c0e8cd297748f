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

Requests in flight together are generated together (``seal/cpu/batched_generation.py``): one thread per
server takes every waiting request, up to ``max_num_seqs`` (verl's rollout key, as in vLLM; 1 generates one
request at a time), and decodes them as one batch while the next requests queue up.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from seal.cpu.batched_generation import GREEDY_EPS, Request, generate_batch

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"

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
    max_num_seqs: int = 256  # requests generated together at most (1: one at a time)
    # How long the generation thread waits, after the first request of a batch arrives, for the requests sent
    # with it: the agent loop's episodes reach the server a few milliseconds apart.
    batch_wait_ms: float = 20.0

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


class IdleServer:
    """The lifecycle calls ``RolloutReplica`` forwards to every server (sleep, wake-up, caches, profiling, the step
    number): nothing to do for a server that holds no GPU memory."""

    def __init__(self):
        self.global_steps: int | None = None

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def ready(self) -> bool:
        return True

    async def wake_up(self, tags: list[str] | None = None, **kwargs: Any) -> None:
        return None

    async def sleep(self, **kwargs: Any) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs: Any) -> dict:
        return {}  # requests are short; nothing is in flight long enough to abort

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


class HFRolloutServer(IdleServer):
    """Token-in/token-out generation server over a HF causal LM (CPU)."""

    def __init__(
        self,
        model_path: str,
        config: HFServerConfig | Any = None,
        replica_rank: int = 0,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.config = config if isinstance(config, HFServerConfig) else HFServerConfig.from_rollout_config(config or {})
        self.replica_rank = replica_rank
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=_torch_dtype(self.config.dtype),
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        ).eval()
        self.model.requires_grad_(False)
        self.eos_ids = self._eos_ids()
        self.max_model_len = self.config.max_model_len or self.model.config.max_position_embeddings
        self._lock = threading.Lock()  # a batch and a weight load never overlap
        self._rng = torch.Generator().manual_seed(self.config.seed + replica_rank)  # seeds of unseeded requests
        self._pending: queue.SimpleQueue[tuple[Request, Future]] = queue.SimpleQueue()
        self.batch_sizes: Counter[int] = Counter()  # how many batches of each size were generated
        threading.Thread(target=self._generation_loop, name="hf-rollout-generation", daemon=True).start()

    def _eos_ids(self) -> list[int]:
        """EOS ids as vLLM sees them: the generation config's list plus the model config's id."""
        gen_cfg, cfg = self.model.generation_config, self.model.config
        return sorted(set(_as_id_list(gen_cfg.eos_token_id)) | set(_as_id_list(cfg.eos_token_id)))

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
        return await asyncio.wrap_future(self.submit(prompt_ids, sampling_params))

    def generate_tokens(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """Blocking generation of one request (batched with whatever else is waiting)."""
        return self.submit(prompt_ids, sampling_params).result()

    def submit(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Future:
        """Queue one request for the generation thread; a bad request fails here, before it is queued."""
        request = self._request(list(prompt_ids), dict(sampling_params or {}))
        future: Future = Future()
        self._pending.put((request, future))
        return future

    def _request(self, prompt_ids: list[int], params: dict[str, Any]) -> Request:
        _check_sampling_keys(params)
        vocab = self.model.config.vocab_size
        if not prompt_ids or not all(0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"hf rollout: a prompt needs at least one token, each in [0, {vocab})")
        temperature = float(params.get("temperature", 1.0))
        if params.get("do_sample") is False:
            temperature = 0.0
        stop_ids = set(_as_id_list(params.get("stop_token_ids")))
        if not bool(params.get("ignore_eos", self.config.ignore_eos)):
            stop_ids |= set(self.eos_ids)
        seed = params.get("seed")
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._rng))
        return Request(
            prompt_ids=prompt_ids,
            max_tokens=self.resolve_max_tokens(len(prompt_ids), params),
            stop_ids=frozenset(stop_ids),
            generator=torch.Generator().manual_seed(int(seed)),
            temperature=0.0 if temperature < GREEDY_EPS else temperature,
            top_k=int(params.get("top_k", -1) or -1),
            top_p=float(params.get("top_p", 1.0)),
            min_p=float(params.get("min_p") or 0.0),
            repetition_penalty=float(params.get("repetition_penalty", self.config.repetition_penalty)),
            want_logprobs=bool(params.get("logprobs", False)),
        )

    def _generation_loop(self) -> None:
        while True:
            batch = self._next_batch()
            self.batch_sizes[len(batch)] += 1
            try:
                with self._lock:
                    generations = generate_batch(
                        self.model, [r for r, _ in batch], raw_logprobs=self.config.logprobs_mode == "raw_logprobs"
                    )
            except Exception as exc:  # every request of the batch gets the error; the loop serves the next
                logger.exception("hf rollout: a batch of %d requests failed", len(batch))
                for _, future in batch:
                    future.set_exception(exc)
                continue
            for (_, future), generation in zip(batch, generations):
                future.set_result(
                    TokenOutput(
                        token_ids=generation.token_ids,
                        log_probs=generation.log_probs,
                        stop_reason="completed",
                        num_preempted=0,
                        extra_fields={"global_steps": self.global_steps},
                    )
                )

    def _next_batch(self) -> list[tuple[Request, Future]]:
        """The first waiting request, and every other one that arrives within the batch window (up to the cap)."""
        batch = [self._pending.get()]
        deadline = time.monotonic() + self.config.batch_wait_ms / 1000
        while len(batch) < self.config.max_num_seqs:
            try:
                batch.append(self._pending.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

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
