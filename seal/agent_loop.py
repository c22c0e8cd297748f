"""The BFCL multi-turn agent loop, registered in verl's agent-loop registry as ``seal_bfcl``
(``seal/config/agent_loops.yaml``, which the launcher passes as ``rollout.agent.agent_loop_config_path``).

One trajectory = one episode on the environment service:

    create episode (train or validate mode) → [generate → env.step]* → evaluate → release

Token discipline:
- the model's turns are the token ids the generation server returned, never re-tokenised text;
- environment messages are appended as chat-template deltas (verl's Continuous Token builder) with mask 0;
- a generation cut by the length limit is closed with the end-of-turn token (``seal.rollout.end_of_turn_token``)
  *inserted* with mask 0, so the context stays well-formed and no token the model did not generate is trained on;
- all turns of an episode carry one request id, so verl's load balancer keeps them on the server whose prefix
  cache holds the context;
- a training sample carries a seed from its step (``seal/resume.py``); each model call samples with its own seed
  drawn from it, so a resumed step does not replay the draws of the run's first steps, and a retried episode
  draws from a seed of its attempt, so it does not replay the draws of the attempt that failed.

At the end the service's verdict is the reward and the trajectory carries its diagnosis (category, progress
tags, paper labels, number of model calls, termination reason) into the batch as ``seal_*`` extra fields.
Text the environment returns is data, never markup: its control strings (the tokenizer's added and special tokens)
are escaped before it enters the context (``env_service/control_text.py``), so no reply can forge a turn boundary.

An episode whose service calls keep failing is retried ``seal.rollout.episode_retries`` times, then returned
with an empty loss mask and ``seal_failed=True``; an episode that cannot start (an unknown task, a first prompt over
``rollout.prompt_length``), gets a reply the loop cannot put into its context (``UnusableEnvReply``), whose generation
fails (``GenerationFailed``) or that fails in any other way is returned the same way at once. Each failed episode
carries the kind of what failed (``seal_failure_kind``: environment, generation, agent loop, task data;
``seal/failed_episodes.py``) and its reason (``seal_error``): nothing one sampled message causes ends the training
step. The trainer counts failed episodes per kind and keeps them out of the GRPO statistics.
Every trajectory — completed, length-cut, zero-call or failed — has the same extra-field
keys and, when the rollout returns log-probs, log-probs: verl joins the agent-loop workers' chunks only if they
agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvServiceError
from env_service.control_text import ControlText
from env_service.vocabulary import mode_for_split, task_category
from seal.env_clients import ENV_CALL_THREADS, NoServiceOnThisNode, env_client
from seal.failed_episodes import (
    AGENT_LOOP,
    ENVIRONMENT,
    ERROR_KEY,
    FAILED_KEY,
    GENERATION,
    KIND_KEY,
    TASK_DATA,
)
from seal.resume import SEED_FIELD, attempt_seed, call_seed

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "\n... truncate ..."
ERROR_TEXT_CHARS = 2000
_ENV_CALLS: ThreadPoolExecutor | None = None


async def env_call(fn, *args):
    """``fn(*args)`` (a blocking service call) on the environment-call threads of this process."""
    global _ENV_CALLS
    if _ENV_CALLS is None:
        _ENV_CALLS = ThreadPoolExecutor(max_workers=ENV_CALL_THREADS, thread_name_prefix="seal-env-call")
    return await asyncio.get_running_loop().run_in_executor(_ENV_CALLS, lambda: fn(*args))


class PromptTooLong(RuntimeError):
    """The first prompt does not fit ``rollout.prompt_length``: retrying cannot help."""


class GenerationFailed(RuntimeError):
    """The rollout server's ``generate`` raised (a vLLM or Ray error): the generation's failure, not the
    environment's."""


class UnusableEnvReply(RuntimeError):
    """A step reply the loop cannot put into the context (not the service's reply shape, or text that is not valid
    Unicode, which the tokenizer refuses); the service never sends one, so the episode fails without a retry."""


#: Service-call errors after which the episode is tried again from the start (the service may be back).
RETRIED = (EnvServiceError, OSError)


def failure_kind(error: BaseException) -> str:
    """What failed, for an error that ended an episode (``seal/failed_episodes.py``)."""
    if isinstance(error, PromptTooLong) or (isinstance(error, EnvServiceError) and error.error == "unknown_task"):
        return TASK_DATA
    if isinstance(error, GenerationFailed):
        return GENERATION
    if isinstance(error, (UnusableEnvReply, NoServiceOnThisNode, *RETRIED)):
        return ENVIRONMENT
    return AGENT_LOOP


@functools.lru_cache(maxsize=8)
def control_text_of(tokenizer) -> ControlText:
    """The tokenizer's control strings, built once per worker process (a loop is made for every trajectory)."""
    return ControlText.from_tokenizer(tokenizer)


@dataclass
class Trajectory:
    """Growing token state of one episode (prompt + interleaved model/env tokens)."""

    token_ids: list[int]
    prompt_len: int
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    env_errors: list[str] = field(default_factory=list)
    model_calls: int = 0
    termination: str = "completed"
    steps: list[tuple[str, dict]] = field(default_factory=list)  # (assistant text, env step reply) per call
    # One id for every turn: verl's load balancer keeps an id on one server, whose prefix cache holds the context.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seed: int | None = None  # the sample's seed (training: from the step, ``seal/resume.py``); None: the server's

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


class BfclAgentLoop(AgentLoopBase):
    """Runs one BFCL episode against the environment service and returns it as a verl ``AgentLoopOutput``."""

    @classmethod
    def outside_workers(cls, config, tokenizer, server, hf_model_type: str = "qwen2") -> BfclAgentLoop:
        """The loop as verl's agent-loop worker builds it, for a composed ``config``, a tokenizer and any object with
        verl's server-manager ``generate`` (a real or scripted server): the tests and benchmarks that run it in-process.
        Build it inside the event loop that runs it (verl's ``AgentLoopBase`` binds to the running loop)."""
        from verl.experimental.agent_loop.agent_loop import DictConfigWrap
        from verl.utils.dataset.rl_dataset import RLHFDataset

        return cls(
            trainer_config=DictConfigWrap(config),
            server_manager=server,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data),
            hf_model_type=hf_model_type,
        )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        seal_cfg = self.config.seal
        env_cfg = self.config.env_service
        self.max_model_calls = int(seal_cfg.rollout.max_model_calls)
        self.max_env_tokens = int(seal_cfg.rollout.max_env_tokens)
        self.episode_retries = int(seal_cfg.rollout.episode_retries)
        self.response_length = int(self.rollout_config.response_length)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.max_model_len = int(self.rollout_config.max_model_len or self.prompt_length + self.response_length)
        # upstream caps every call at the whole response budget; a smaller cap leaves room for later turns
        self.max_tokens_per_call = int(seal_cfg.rollout.max_tokens_per_call or self.response_length)
        self.env_params = _to_container(env_cfg.bfcl)
        self.reward_params = _to_container(seal_cfg.reward)
        # the node's service is looked up in the episode (``_service``), off the event loop: on several nodes that
        # asks a Ray actor, and a missing service must fail the episode with its kind, not this loop's worker
        self.env = None
        self.control_text = control_text_of(self.tokenizer)
        self.eos_id = end_of_turn_id(self.tokenizer, seal_cfg.rollout.end_of_turn_token)
        # ``python -m seal.eval``: one record per episode in this results file (off in training)
        self.results_path = seal_cfg.eval.results_path

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        extra = kwargs["extra_info"]
        task_id, mode = extra["task_id"], mode_for_split(extra.get("split"))
        metrics: dict[str, Any] = {}
        want_logprobs = bool(sampling_params.get("logprobs"))
        seed, attempt = kwargs.get(SEED_FIELD), 0
        while True:
            try:
                return await self._run_episode(
                    task_id, mode, sampling_params, metrics, want_logprobs, attempt_seed(seed, attempt)
                )
            except Exception as exc:  # noqa: BLE001 - whatever fails, this episode fails, not the step
                kind = failure_kind(exc)
                if kind != ENVIRONMENT or not isinstance(exc, RETRIED) or attempt >= self.episode_retries:
                    logger.error("episode %s failed (kind %s): %s", task_id, kind, exc, exc_info=kind == AGENT_LOOP)
                    return self._failed_output(task_id, extra, kind, _describe(exc), metrics, want_logprobs)
                logger.warning(
                    "episode %s attempt %d/%d failed: %s", task_id, attempt + 1, self.episode_retries + 1, exc
                )
                await asyncio.sleep(min(2.0**attempt, 8.0) * 0.25)
                attempt += 1

    # ---- one episode -------------------------------------------------------------------------------

    async def _run_episode(
        self, task_id: str, mode: str, sampling_params: dict, metrics: dict, want_logprobs: bool, seed: int | None
    ) -> AgentLoopOutput:
        env = await self._service()
        created = await self._env_call(env.create, task_id, mode, self.env_params)
        instance_id = created["instance_id"]
        try:
            traj = await self._start(created["messages"])
            traj.seed = seed
            await self._interact(traj, instance_id, keep_alive_interval(created["info"]), sampling_params, metrics)
            evaluation = await self._env_call(self.env.evaluate, instance_id, self.reward_params, True)
        except BaseException:
            await self._release_quietly(instance_id)  # evaluate releases on success; a failure must too
            raise
        return self._output(task_id, created["info"], traj, evaluation, metrics, want_logprobs)

    async def _start(self, messages: list[dict]) -> Trajectory:
        prompt_ids = await self.loop.run_in_executor(
            None, lambda: self.continuous_token_builder.build_initial_tokens(messages)
        )
        if len(prompt_ids) > self.prompt_length:
            raise PromptTooLong(
                f"The first prompt has {len(prompt_ids)} tokens but rollout.prompt_length is {self.prompt_length}; "
                "raise data.max_prompt_length (the BFCL tool schemas are long) instead of truncating the prompt."
            )
        return Trajectory(token_ids=list(prompt_ids), prompt_len=len(prompt_ids), messages=list(messages))

    async def _interact(
        self, traj: Trajectory, instance_id: str, keep_alive_s: float, sampling_params: dict, metrics: dict
    ) -> None:
        context_budget = self.max_model_len - self.response_length
        while True:
            if traj.model_calls >= self.max_model_calls:
                traj.termination = "max_model_calls"
                return
            if len(traj.token_ids) >= context_budget:
                traj.termination = "context_budget"
                return
            text = await self._while_touching(instance_id, keep_alive_s, self._generate(traj, sampling_params, metrics))
            with _timer(metrics, "tool_calls"):
                step = await self._env_call(self.env.step, instance_id, text)
            reply = usable_reply(step)  # ipython mode: one message per tool result
            if self.results_path:  # only `python -m seal.eval` keeps the replies (for its per-task record)
                traj.steps.append((text, step))
            if step["terminated"]:
                traj.termination = "completed"
                return
            if step["info"]["error_type"] is not None:  # the service says why the reply is an error
                traj.env_errors.append("\n".join(m["content"] for m in reply)[:ERROR_TEXT_CHARS])
            await self._append_env_messages(traj, reply)

    async def _generate(self, traj: Trajectory, sampling_params: dict, metrics: dict) -> str:
        params = {**sampling_params, "max_tokens": self.max_tokens_per_call}
        seed = call_seed(traj.seed, traj.model_calls)
        if seed is not None:  # each call its own draw; the same (step, sample, call) draws the same in any run
            params["seed"] = seed
        with _timer(metrics, "generate_sequences"):
            try:
                output = await self.server_manager.generate(
                    request_id=traj.request_id, prompt_ids=traj.token_ids, sampling_params=params
                )
            except Exception as exc:  # a vLLM or Ray error: named for the generation, never for the environment
                raise GenerationFailed(_describe(exc)) from exc
        traj.model_calls += 1
        generated = list(output.token_ids)
        merge, mask, logprobs = await self.ct_merge_assistant_token(
            traj.token_ids,
            generated,
            traj.response_mask,
            traj.response_logprobs if output.log_probs else None,
            assistant_logprobs=list(output.log_probs) if output.log_probs else None,
        )
        traj.token_ids, traj.response_mask = merge.token_ids, mask
        if logprobs is not None:
            traj.response_logprobs = logprobs
        if not generated or generated[-1] != self.eos_id:
            # Length-truncated turn: close it for the context, but never train on the inserted token.
            traj.token_ids.append(self.eos_id)
            traj.response_mask.append(0)
            if traj.response_logprobs:
                traj.response_logprobs.append(0.0)
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": text})
        return text

    async def _while_touching(self, instance_id: str, keep_alive_s: float, generation):
        """The generation's result, the episode touched every ``keep_alive_s`` meanwhile: a generation queued behind
        a step's other episodes can wait longer than the service's idle limit, and an episode reclaimed under it
        would be retried from its start (its turns so far generated again). The reclaim stays for clients that
        are gone: a dead trainer touches nothing."""
        toucher = asyncio.create_task(self._touch_every(instance_id, keep_alive_s))
        try:
            return await generation
        finally:
            toucher.cancel()

    async def _touch_every(self, instance_id: str, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._env_call(self.env.touch, instance_id)
            except Exception as exc:  # noqa: BLE001 - the next step reports what is wrong; a touch fails nothing
                logger.warning("touching episode %s failed: %s", instance_id, _describe(exc))

    async def _append_env_messages(self, traj: Trajectory, reply: list[dict]) -> None:
        previous = list(traj.messages)
        for message in reply:
            # Llama-3.1 tool results (env role ``ipython``) go in as ``tool`` messages: verl's token builder appends
            # only tool/user/system/assistant roles, and a Llama-3.1 template renders ``tool`` as the ipython turn.
            role = "tool" if message.get("role") == "ipython" else "user"
            traj.messages.append({"role": role, "content": self._context_text(message["content"])})
        merge, mask, logprobs = await self.ct_merge_context_msg(
            previous,
            traj.messages,
            traj.token_ids,
            traj.response_mask,
            traj.response_logprobs if traj.response_logprobs else None,
        )
        traj.token_ids, traj.response_mask = merge.token_ids, mask
        if logprobs is not None and traj.response_logprobs:
            traj.response_logprobs = logprobs

    def _context_text(self, content: str) -> str:
        """An environment message as the context holds it: data (its control strings escaped), then clipped; in that
        order, so a control string counts as the ordinary tokens it becomes."""
        return self._clip_env_text(self.control_text.escape(content))

    def _clip_env_text(self, content: str) -> str:
        """Environment messages longer than ``max_env_tokens`` keep their first tokens plus a marker."""
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if len(ids) <= self.max_env_tokens:
            return content
        marker_len = len(self.tokenizer.encode(TRUNCATION_MARKER, add_special_tokens=False))
        return self.tokenizer.decode(ids[: self.max_env_tokens - marker_len]) + TRUNCATION_MARKER

    # ---- service calls -----------------------------------------------------------------------------

    async def _env_call(self, fn, *args):
        return await env_call(fn, *args)

    async def _service(self):
        """This node's environment client, looked up on the env-call threads (once per process: it is cached)."""
        if self.env is None:
            try:
                self.env = await env_call(env_client, self.config.env_service)
            except NoServiceOnThisNode:
                raise
            except Exception as exc:  # a Ray error asking the node's actor: the environment is what is missing
                raise NoServiceOnThisNode(f"looking up this node's environment service: {_describe(exc)}") from exc
        return self.env

    async def _release_quietly(self, instance_id: str) -> None:
        try:
            await self._env_call(self.env.release, instance_id)
        except Exception as exc:  # the service reclaims idle episodes anyway
            logger.warning("release of %s failed: %s", instance_id, exc)

    # ---- outputs -------------------------------------------------------------------------------------

    def _output(
        self, task_id: str, info: dict, traj: Trajectory, evaluation: dict, metrics: dict, want_logprobs: bool
    ) -> AgentLoopOutput:
        response_ids = traj.token_ids[traj.prompt_len :][: self.response_length]
        fields = diagnosis_fields(task_id, info.get("category"), evaluation, traj.model_calls, traj.termination)
        fields["seal_env_errors"] = traj.env_errors
        fields["seal_response_truncated"] = traj.response_len > self.response_length
        if self.results_path:
            self._write_record(task_id, evaluation, traj)
        return AgentLoopOutput(
            prompt_ids=traj.token_ids[: traj.prompt_len],
            response_ids=response_ids,
            response_mask=traj.response_mask[: self.response_length],
            response_logprobs=_aligned_logprobs(traj.response_logprobs, len(response_ids)) if want_logprobs else None,
            reward_score=float(evaluation["reward"]),
            num_turns=traj.model_calls,
            metrics=AgentLoopMetrics(**metrics),
            extra_fields={**fields, "reward_extra_info": reward_extra_info(float(evaluation.get("progress", 0.0)))},
        )

    def _failed_output(
        self, task_id: str, extra: dict, kind: str, error: str, metrics: dict, want_logprobs: bool
    ) -> AgentLoopOutput:
        termination = "env_error" if kind == ENVIRONMENT else f"{kind}_error"
        fields = diagnosis_fields(task_id, extra.get("category"), None, 0, termination)
        fields.update(seal_failed=True, seal_failure_kind=kind, seal_error=error[:500])
        if self.results_path:
            failed = Trajectory(token_ids=[], prompt_len=0, termination=termination)
            self._write_record(task_id, None, failed, error, failed_by=kind)
        return AgentLoopOutput(
            prompt_ids=[self.eos_id],
            response_ids=[self.eos_id],
            response_mask=[0],  # nothing of a failed episode enters the loss
            response_logprobs=[0.0] if want_logprobs else None,
            reward_score=0.0,
            num_turns=0,
            metrics=AgentLoopMetrics(**metrics),
            extra_fields={**fields, "reward_extra_info": reward_extra_info(0.0, kind, error)},
        )

    def _write_record(
        self, task_id: str, evaluation: dict | None, traj: Trajectory, error: str = "", failed_by: str = ENVIRONMENT
    ) -> None:
        from seal.results.records import TurnLog, append_record, make_record

        log = TurnLog(self.env_params.get("tool_prompt_mode", "bfcl_qwen_fc"))
        for text, step in traj.steps:
            log.add(text, step["message"], step["info"], step["terminated"])
        tokens = {"prompt": traj.prompt_len, "completion": sum(traj.response_mask)}
        source = {"mode": "checkpoint", "model": str(self.config.actor_rollout_ref.model.path)}
        append_record(
            self.results_path,
            make_record(
                task_id,
                evaluation,
                log.as_list(),
                model_calls=traj.model_calls,
                termination=traj.termination,
                tokens=tokens,
                source=source,
                failed=evaluation is None,
                error=error,
                failed_by=failed_by,
            ),
        )


def keep_alive_interval(info: dict) -> float:
    """How often a waiting episode is touched: three times within the service's idle limit (its create answer says
    it; a service that does not: the default limit), so one touch lost to a slow round trip costs nothing."""
    idle_s = info.get("idle_timeout_s", ServiceLimits().idle_timeout_s)
    return max(float(idle_s) / 3, 0.05)


def usable_reply(step: Any) -> list[dict]:
    """The messages of a step reply (``message``, then ``extra_messages``), checked for what the loop relies on: the
    service's reply shape and valid text in every message (``UnusableEnvReply`` naming the problem otherwise)."""
    if not isinstance(step, dict) or not isinstance(step.get("terminated"), bool):
        raise UnusableEnvReply(f"the step reply is not the service's shape: {str(step)[:200]!r}")
    if not isinstance(step.get("info"), dict) or "error_type" not in step["info"]:
        raise UnusableEnvReply("the step reply has no info.error_type")
    extra = step.get("extra_messages", [])
    messages = [step.get("message"), *(extra if isinstance(extra, list) else [None])]
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            raise UnusableEnvReply(f"reply message {index} has no text content: {str(message)[:200]!r}")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as error:
            raise UnusableEnvReply(
                f"reply message {index} is not valid Unicode (a lone surrogate {ascii(content[error.start])} at "
                f"index {error.start}); the tokenizer cannot take it"
            ) from None
    return messages


def diagnosis_fields(task_id: str, category: str | None, evaluation: dict | None, calls: int, termination: str) -> dict:
    """The per-trajectory diagnosis that flows into the batch (``non_tensor_batch['seal_*']``)."""
    evaluation = evaluation or {}
    return {
        "seal_task_id": task_id,
        "seal_category": category or evaluation.get("category") or task_category(task_id),
        "seal_tags": list(evaluation.get("tags", [])),
        "seal_labels": list(evaluation.get("labels", [])),
        "seal_model_calls": calls,
        "seal_termination": termination,
        "seal_env_errors": [],
        "seal_response_truncated": False,
        "seal_failed": False,
        "seal_failure_kind": "",
        "seal_error": "",
    }


def reward_extra_info(progress: float, kind: str = "", error: str = "") -> dict:
    """Per-sample values verl carries into validation (``seal/failed_episodes.py`` reads and drops the failure keys);
    the same keys for every trajectory."""
    return {"progress": progress, FAILED_KEY: float(bool(kind)), KIND_KEY: kind, ERROR_KEY: error[:500]}


def _describe(error: BaseException) -> str:
    """An error as its type and message: the first text a stop message quotes."""
    return str(error) if isinstance(error, (GenerationFailed, EnvServiceError)) else f"{type(error).__name__}: {error}"


def end_of_turn_id(tokenizer, token: str) -> int:
    """The id of the chat template's end-of-turn token (``<|im_end|>`` for Qwen, ``<|eot_id|>`` for Llama 3.1).

    Not ``eos_token_id``: for a Llama-3.1 tokenizer that may be ``<|end_of_text|>``, which would make every
    turn look length-cut.
    """
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(
            f"seal.rollout.end_of_turn_token {token!r} is not a token of this tokenizer; set it to the token the "
            "chat template ends an assistant turn with"
        )
    return token_id


def _aligned_logprobs(logprobs: list[float], length: int) -> list[float]:
    """Log-probs for exactly ``length`` response tokens (0 where nothing was sampled: prompts, env, inserted)."""
    return (list(logprobs) + [0.0] * length)[:length]


@contextlib.contextmanager
def _timer(metrics: dict, key: str):
    """Accumulate wall seconds under ``key`` (verl's AgentLoopMetrics fields)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


def _to_container(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
