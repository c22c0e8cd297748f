"""One BFCL multi-turn episode: what the model sees and what its messages do, step by step.

An :class:`Episode` shows the model a system prompt and the first user question, then answers every
assistant message with exactly one message:

* the message has parse errors (strict parser) -> ``[ERROR] Invalid tool call format: <errors>``; the turn
  does not advance and nothing runs;
* it has calls, and one of them names a tool outside the *current* tool list (``enforce_available_tools``)
  or is otherwise unusable -> ``[ERROR] Invalid tool call format: <reason>``; nothing runs;
* it has calls -> they run, in order, on the episode's own backends; the reply is the concatenation of one
  ``<tool_response>`` block per call;
* it has no calls -> the next user turn: a holdout turn reveals its functions (reveal message; the tools
  become callable, the system prompt is never updated), the last turn ends the episode with
  ``[CONVERSATION_COMPLETED]``, otherwise the next question.

Limits (:class:`~env_service.bfcl.config.ServiceLimits`; every refusal is a text the model reads):

* a message with more than ``max_calls_per_message`` calls is refused like a parse error (nothing runs);
* the step after ``max_steps``, or after the episode's messages used ``episode_cpu_budget_s`` of CPU together, is
  answered with a limit text and ends the episode;
* each call runs under ``call_budget_s`` and ``call_memory_mib``, the message's calls together under
  ``message_budget_s``: a call over its budget is stopped (its partial effects stay), later calls of the
  message are skipped, and each gets an ``Error during execution: ...`` result; the verifier tags the turn
  ``budget_exceeded``;
* the reply is cut to ``max_reply_bytes`` with a marker;
* after each message the backend state is measured (:func:`~env_service.sizes.measured_bytes`); above
  ``max_state_bytes`` the reply says so and tool calls are refused for the rest of the episode;
* every reply reports what the episode keeps (``info["kept_bytes"]``: records and state), which the service adds
  up per owner (``max_owner_bytes``).

The episode records, per user turn, the evidence the verifier needs (accepted calls, parse errors,
rejected calls) and :meth:`Episode.evaluate` scores it. Train-only interface features (observation-lite,
recovery feedback, capability cues; see ``interface.py``) apply in ``train`` mode only, unless a block sets
``apply_to_validation``. Episodes share nothing: each owns a :class:`BackendSession`.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from env_service.bfcl import interface, prompts
from env_service.bfcl.calls import ToolCall
from env_service.bfcl.config import EnvConfig, RewardConfig, ServiceLimits
from env_service.bfcl.executor import (
    BackendSession,
    CallOverBudget,
    ToolNotAvailable,
    clip_text,
    clip_texts,
    time_limit,
)
from env_service.bfcl.parser import ParsedMessage, call_problem, parse_assistant, shown_name
from env_service.bfcl.tasks import Task
from env_service.bfcl.verifier import TurnRecord, evaluate_episode, over_budget_text
from env_service.control_text import SERVICE_MARKUP
from env_service.sizes import measured_bytes
from env_service.vocabulary import (
    EPISODE_MODES,
    ERROR_MARKER,
    MODE_TRAIN,
    STEP_BUDGET_EXCEEDED,
    STEP_LIMIT_EXCEEDED,
    STEP_PARSE_ERROR,
    STEP_TOOL_ERROR,
    STEP_UNAVAILABLE_TOOL,
    is_execution_error,
)

# The released environment's texts for calls the parser let through but the executor cannot take.
_MISSING_NAME = "Missing function name in tool call."


@dataclass
class StepResult:
    """The environment's reply to one assistant message."""

    message: dict
    terminated: bool
    info: dict = field(default_factory=dict)
    # More messages of the same reply: in ``ipython`` mode each tool result is its own message, as bfcl's
    # Llama handler sends them; empty otherwise.
    extra_messages: list[dict] = field(default_factory=list)


def _tool_name(doc: Mapping) -> str:
    name = doc.get("name") or (doc.get("function") or {}).get("name") or ""
    return str(name)


def _bounded_errors(errors: list[str], limit: int) -> list[str]:
    """The first ``limit`` errors, and one line counting the rest (a message of 10,000 broken blocks is one
    mistake repeated; the model needs a few examples, not all of them)."""
    if len(errors) <= limit:
        return errors
    return [*errors[:limit], f"... and {len(errors) - limit} more errors in this message"]


#: Measured bytes of a task's copy, per task id: every episode holds its own copy (``tasks.load_task`` deep-copies),
#: and the copies of one task are alike, so each task is measured once per process.
_TASK_BYTES: dict[str, int] = {}
#: Measured bytes of an episode's backends before its first message, per (task id, episode class).
_INITIAL_STATE_BYTES: dict[tuple[str, str], int] = {}


def _task_bytes(task: Task) -> int:
    if task.id not in _TASK_BYTES:
        _TASK_BYTES[task.id] = measured_bytes(task, leaves=False)  # its strings are the original's
    return _TASK_BYTES[task.id]


def _first_user_content(turn: list) -> str:
    """Content of the first ``user`` message of a question turn ("" if none, like the released environment)."""
    for message in turn or []:
        if isinstance(message, dict) and message.get("role") == "user":
            return message.get("content", "")
    return ""


class Episode:
    """See the module docstring. ``mode``: ``train`` or ``validate``.

    ``profile``: the failure profile the trainer last pushed (``{"step", "tags", "categories"}``), used for
    capability cues; read once, at construction. ``limits``: the service's budgets and limits.
    """

    def __init__(
        self,
        task: Task,
        mode: str = MODE_TRAIN,
        config: EnvConfig | None = None,
        profile: Mapping[str, Any] | None = None,
        limits: ServiceLimits | None = None,
    ):
        if mode not in EPISODE_MODES:
            raise ValueError(f"unknown episode mode {mode!r}; expected one of {', '.join(EPISODE_MODES)}")
        self.task = task
        self.mode = mode
        self.config = config if config is not None else EnvConfig()
        self.limits = limits if limits is not None else ServiceLimits()
        self._tools_refused: str | None = None  # why tool calls are refused for good (state limit)
        # The tools the model may call now: the task's visible docs, plus revealed holdouts later.
        self._tools: list[dict] = list(task.functions)
        self._session = self._open_session()
        self._turn = 0  # index of the user turn the model is answering
        self._records: list[TurnRecord] = [TurnRecord(calls=[], exec_results=[])]
        self._num_steps = 0
        self._cpu_s = 0.0  # CPU seconds its messages used together (episode_cpu_budget_s)
        self._terminated = False
        self._kept_bytes = 0  # what this episode keeps between messages (records), see _keeps
        self._state_bytes = 0  # its backend state as last measured (_check_state)
        self._obs_lite = self._active(self.config.observation_lite)
        self._feedback = self._active(self.config.tool_feedback_evolution)
        cues = self._capability_cues(profile)
        self._system = self._system_prompt(cues)
        self.info = {
            "tool_prompt_mode": self.config.tool_prompt_mode,
            "questions_count": len(task.question),
            "observation_lite": self._obs_lite,
            "tool_feedback": self._feedback,
            "capability_cues": bool(cues),
            "capability_cue_lines": cues.count("\n- ") if cues else 0,
        }
        # What it holds from its creation, measured: its own copy of the task, its prompt, its backends' state (an
        # idle episode once counted only its prompt: ~25 KB of the ~150 KB it held in its worker and the service).
        self._held_bytes = _task_bytes(task) + measured_bytes(self._held())
        self._state_bytes = self._initial_state_bytes()
        self.info["kept_bytes"] = self.kept_bytes

    # -- public API -----------------------------------------------------------------------------

    @property
    def terminated(self) -> bool:
        return self._terminated

    @property
    def kept_bytes(self) -> int:
        """What the episode keeps now: its task and prompt, its records, its backend state as last measured, and
        files of its own (``_disk_bytes``). Every reply reports it (``info["kept_bytes"]``, the creation's info too),
        so the service totals an owner's episodes (``max_owner_bytes``) without asking the worker that holds them."""
        return self._held_bytes + self._kept_bytes + self._state_bytes + self._disk_bytes()

    def _held(self) -> list:
        """What the episode holds for its whole life beside its task, records and backends (measured at creation)."""
        return [self._system]

    def _disk_bytes(self) -> int:
        """Bytes of files the episode keeps (none: the multi-turn backends keep their files in memory)."""
        return 0

    def _initial_state_bytes(self) -> int:
        """Its backends' state before the first message: fresh copies of the task's, alike for every episode of the
        task, so measured once per task (and backend flavour) in a process."""
        key = (self.task.id, type(self).__name__)
        if key not in _INITIAL_STATE_BYTES:
            _INITIAL_STATE_BYTES[key] = measured_bytes(dict(self._session.instances))
        return _INITIAL_STATE_BYTES[key]

    def _measured_state(self) -> int:
        return measured_bytes(dict(self._session.instances), self.limits.max_state_bytes)

    @property
    def turn(self) -> int:
        """Index of the user turn the model is currently answering."""
        return self._turn

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def tool_names(self) -> list[str]:
        """Names of the tools the model may call now (in the order they were shown)."""
        return [_tool_name(doc) for doc in self._tools]

    @property
    def turn_records(self) -> list[TurnRecord]:
        """A copy of the per-turn evidence so far (one record per user turn delivered)."""
        return copy.deepcopy(self._records)

    def initial_messages(self) -> list[dict]:
        """``[system, user]``; the user text is the first message of the first question turn."""
        first = _first_user_content(self.task.question[0]) if self.task.question else ""
        return [{"role": "system", "content": self._system}, {"role": "user", "content": first}]

    def step(self, assistant_text: str) -> StepResult:
        """Apply one assistant message (raw model text) and return the environment's reply."""
        if self._terminated:
            raise ValueError(
                f"episode for {self.task.id} has already terminated ({prompts.CONVERSATION_COMPLETED} was "
                f"sent after {self._num_steps} steps); evaluate it or start a new episode"
            )
        self._num_steps += 1
        if self._num_steps > self.limits.max_steps:
            return self._end(f"reached its limit of {self.limits.max_steps} messages")
        if self._cpu_s > self.limits.episode_cpu_budget_s:
            return self._end(f"used its CPU time budget of {self.limits.episode_cpu_budget_s:g} s")
        started = time.thread_time()  # the CPU of this thread: the message's reading and calls run here
        try:
            return self._step(assistant_text)
        finally:
            self._cpu_s += time.thread_time() - started

    def _end(self, why: str) -> StepResult:
        self._terminated = True
        text = f"{ERROR_MARKER} This episode {why} and has ended; nothing in the last message was run."
        return self._reply(text, terminated=True, error_type=STEP_LIMIT_EXCEEDED)

    def _step(self, assistant_text: str) -> StepResult:
        deadline = time.monotonic() + self.limits.message_budget_s  # reading the message and its calls share it
        parsed = self._parse(assistant_text)
        if parsed is None:
            return self._reject_parse_errors(ParsedMessage(content="", errors=[self._unread_text()]))
        if self._kept_bytes > self.limits.max_episode_bytes:
            return self._end_over_memory()
        if parsed.errors:
            return self._reject_parse_errors(parsed)
        if len(parsed.calls) > self.limits.max_calls_per_message:
            return self._reject_call_count(parsed)
        if parsed.calls:
            return self._handle_calls(parsed, deadline)
        return self._next_user_turn()

    def evaluate(self, reward_cfg: RewardConfig | None = None) -> dict:
        """The verifier's evaluation of the turns so far, plus ``num_turns`` and ``num_steps``.

        Without ``reward_cfg`` the episode's own ``config.reward`` block applies. May be called any time
        (an unfinished episode is scored as force-terminated when it has fewer turns than the GT).
        """
        if reward_cfg is None:
            reward_cfg = self.config.reward
        result = evaluate_episode(self.task, self.turn_records, reward_cfg, self.limits).to_dict()
        result["num_turns"] = len(self._records)
        result["num_steps"] = self._num_steps
        return result

    def close(self) -> None:
        """Free the backend instances (the episode can still be evaluated: the verifier replays)."""
        self._session.close()

    # -- construction helpers -------------------------------------------------------------------

    def _active(self, block) -> bool:
        return interface.is_train_only_active(block, self.mode, self.task.category)

    def _open_session(self) -> BackendSession:
        """The episode's backends: fresh instances of the task's classes."""
        return BackendSession(self.task, allowed=self._allowed_names())

    def _allowed_names(self) -> set[str] | None:
        return set(self.tool_names) if self.config.enforce_available_tools else None

    def _capability_cues(self, profile: Mapping[str, Any] | None) -> str:
        cfg = self.config.capability_cues
        if profile is None or not self._active(cfg):
            return ""
        return interface.capability_cues(profile, cfg, self.task.category)

    def _system_prompt(self, cues: str) -> str:
        tools = self._tools
        extra = []
        if self._obs_lite:
            tools = interface.observation_lite(tools, self.config.observation_lite)
            extra.append(self.config.observation_lite.instruction)
        if cues:
            extra.append(cues)
        tool_prompt = prompts.tools_system_prompt(tools, self.config.tool_prompt_mode)
        return prompts.system_content(tool_prompt, extra)

    # -- step helpers ---------------------------------------------------------------------------

    def _parse(self, assistant_text: str) -> ParsedMessage | None:
        """The message's calls, read within the message's time budget (None when reading it ran past it).

        The parsers' Python work is interrupted like a call; ``ast.parse`` and ``json.loads`` are C code that no
        timer stops (at most ~2 s on 256 KiB), which the worker's deadline of budget plus grace bounds.
        """
        try:
            with time_limit(self.limits.message_budget_s):
                return parse_assistant(assistant_text, self.config.tool_prompt_mode, self.config.strict_tool_parser)
        except CallOverBudget:
            return None

    def _unread_text(self) -> str:
        return (
            f"the message could not be read within its time budget of {self.limits.message_budget_s:g} s; "
            f"nothing was run"
        )

    def _reply(
        self,
        content: str,
        *,
        role: str = "user",
        terminated: bool = False,
        extra: tuple[str, ...] = (),
        framed: bool = False,
        **info,
    ) -> StepResult:
        info = {
            "turn": self._turn,
            "num_turns": len(self._records),
            "num_steps": self._num_steps,
            "error_type": None,
            "num_calls": 0,
            "num_rejected_calls": 0,
            "num_parse_errors": 0,
            "num_tool_errors": 0,
            "advanced": False,
            "kept_bytes": self.kept_bytes,
            **info,
        }
        if not framed:  # text that is not tool results in their framing holds none of the framing's tags
            content, extra = SERVICE_MARKUP.escape(content), tuple(SERVICE_MARKUP.escape(t) for t in extra)
        # Every reply, whatever produced it, within max_reply_bytes (its messages together).
        content, *extra = clip_texts([content, *extra], self.limits.max_reply_bytes)
        return StepResult(
            message={"role": role, "content": content},
            terminated=terminated,
            info=info,
            extra_messages=[{"role": role, "content": text} for text in extra],
        )

    # -- what an episode keeps ------------------------------------------------------------------

    def _keeps(self, arguments: list[dict]) -> bool:
        """Charge the arguments (the verifier replays them) and results of accepted calls to the episode's
        budget, the results at ``max_reply_bytes`` until they are known (``_execute`` settles it); False when they
        do not fit (then nothing of the message is run or kept)."""
        limit = self.limits.max_episode_bytes
        cost = measured_bytes(arguments, max(limit - self._kept_bytes, 0)) + self.limits.max_reply_bytes
        if self._kept_bytes + cost > limit:
            return False
        self._kept_bytes += cost
        return True

    def _end_over_memory(self) -> StepResult:
        self._terminated = True
        text = (
            f"{ERROR_MARKER} This episode's records reached their memory limit of {self.limits.max_episode_bytes} "
            f"bytes and it has ended; nothing in the last message was run."
        )
        return self._reply(text, terminated=True, error_type=STEP_LIMIT_EXCEEDED)

    def _rejected(self, record: TurnRecord, parsed_calls: list[ToolCall], errors: list[str] = ()) -> None:
        """Keep the evidence of refused calls at a bounded cost: the verifier needs only that there were some
        (a few names, no arguments), and a few of the errors."""
        names = [
            ToolCall(name=shown_name(c.name), arguments={}) for c in parsed_calls[: self.limits.max_errors_per_message]
        ]
        errors = _bounded_errors(list(errors), self.limits.max_errors_per_message)
        record.rejected_calls.extend(names)
        record.parse_errors.extend(errors)
        self._kept_bytes += sum(64 + len(c.name) for c in names) + sum(64 + len(e) for e in errors)

    def _error_message(self, error: str, error_type: str = STEP_PARSE_ERROR) -> str:
        message = prompts.invalid_tool_call_message(error)
        if self._feedback:
            message = interface.enrich_parse_error(
                message,
                self.tool_names,
                self.config.tool_feedback_evolution,
                self.config.tool_prompt_mode,
                format_hint=error_type == STEP_PARSE_ERROR,
            )
        return message

    def _reject_parse_errors(self, parsed: ParsedMessage) -> StepResult:
        self._rejected(self._records[-1], parsed.calls, parsed.errors)
        shown = _bounded_errors(parsed.errors, self.limits.max_errors_per_message)
        return self._reply(
            self._error_message("; ".join(shown)),
            error_type=STEP_PARSE_ERROR,
            num_rejected_calls=len(parsed.calls),
            num_parse_errors=len(parsed.errors),
        )

    def _reject_call_count(self, parsed: ParsedMessage) -> StepResult:
        problem = (
            f"{len(parsed.calls)} tool calls in one message; the limit is "
            f"{self.limits.max_calls_per_message}. Nothing was run."
        )
        self._rejected(self._records[-1], parsed.calls, [problem])
        return self._reply(
            self._error_message(problem),
            error_type=STEP_LIMIT_EXCEEDED,
            num_rejected_calls=len(parsed.calls),
            num_parse_errors=1,
        )

    def _handle_calls(self, parsed: ParsedMessage, deadline: float) -> StepResult:
        calls, problem, error_type = self._checked_calls(parsed.calls)
        if problem is None and not self._keeps([call.arguments for call in calls]):
            return self._end_over_memory()
        if problem is None:
            try:
                return self._execute(calls, deadline)
            except ToolNotAvailable as exc:  # cannot happen while allowed == current tools; stay safe
                problem, error_type = str(exc), STEP_UNAVAILABLE_TOOL
        self._rejected(self._records[-1], parsed.calls, [problem] if error_type == STEP_PARSE_ERROR else [])
        return self._reply(
            self._error_message(problem, error_type),
            error_type=error_type,
            num_rejected_calls=len(parsed.calls),
            num_parse_errors=int(error_type == STEP_PARSE_ERROR),
        )

    def _checked_calls(self, calls: list[ToolCall]) -> tuple[list[ToolCall], str | None, str | None]:
        """The released environment's pre-execution checks, in call order; the first failing call rejects the
        message.

        Returns (calls with decoded arguments, None, None) or ([], reason, error_type). String arguments
        only reach here from the lenient parser; they are JSON-decoded as the released environment does, and then
        held to the limits the parsers hold every call to (``call_problem``: depth, valid text).
        """
        names = set(self.tool_names) if self.config.enforce_available_tools else None
        checked = []
        for call in calls:
            name, arguments = call.name, call.arguments
            if not name:
                return [], _MISSING_NAME, STEP_PARSE_ERROR
            if isinstance(name, (list, dict)):  # the released environment looks names up in a set, which raises
                return [], f"unhashable type: '{type(name).__name__}'", STEP_PARSE_ERROR
            if names is not None and not (isinstance(name, str) and name in names):
                reason = f"Tool '{shown_name(name)}' is not available in the current tool list."
                return [], reason, STEP_UNAVAILABLE_TOOL
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except Exception:
                    reason = f"Tool '{shown_name(name)}' has invalid JSON arguments: {shown_name(arguments)}"
                    return [], reason, STEP_PARSE_ERROR
            if not isinstance(arguments, dict):
                return [], f"Tool '{shown_name(name)}' arguments must be a JSON object.", STEP_PARSE_ERROR
            problem = call_problem(name, arguments)  # the parsers' limits, on arguments decoded only here too
            if problem:
                return [], problem, STEP_PARSE_ERROR
            checked.append(ToolCall(name=name, arguments=arguments))
        return checked, None, None

    def _run_call(self, call: ToolCall, deadline: float) -> tuple[str, bool]:
        """(result, stopped or skipped by a budget) of one call with what is left of the message budget."""
        if self._tools_refused:
            return over_budget_text(self._tools_refused), True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return over_budget_text(
                f"not run: this message used up its time budget of {self.limits.message_budget_s:g} s"
            ), True
        try:
            return self._session.execute(
                call, min(self.limits.call_budget_s, remaining), self.limits.call_memory_mib * 2**20
            ), False
        except CallOverBudget as stopped:
            return over_budget_text(str(stopped)), True

    def _check_state(self, record: TurnRecord, first: int) -> str:
        """After a message: refuse tools for good when the state has grown past its limit ("" if fine)."""
        limit = self.limits.max_state_bytes
        if self._tools_refused:  # the state no longer changes
            return ""
        self._state_bytes = self._measured_state()
        if self._state_bytes <= limit:
            return ""
        self._tools_refused = (
            f"tool calls are refused: this episode's environment state grew past its limit of {limit} bytes"
        )
        # The replay must not rebuild that state: the message's calls count as stopped.
        record.over_budget.extend(i for i in range(first, len(record.calls)) if i not in record.over_budget)
        return (
            f"\n{ERROR_MARKER} The environment state exceeds its limit of {limit} bytes; "
            f"tool calls are refused for the rest of this episode."
        )

    def _execute(self, calls: list[ToolCall], deadline: float) -> StepResult:
        mode = self.config.tool_result_mode
        record = self._records[-1]
        first = len(record.calls)
        room = self.limits.max_reply_bytes  # bytes of results kept in the record for this message
        results, tool_errors, over = [], 0, 0  # one rendered text per call (its recovery hint included)
        for call in calls:
            result, stopped = self._run_call(call, deadline)
            if stopped:
                over += 1
                record.over_budget.append(len(record.calls))
            record.calls.append(call)
            kept = clip_text(result, max(room, 0))
            room -= len(kept)
            record.exec_results.append(kept)
            text = prompts.render_tool_result(result, mode)
            if is_execution_error(result):
                tool_errors += 1
                if self._feedback:  # after the block: it names the call, which is the model's text
                    text += SERVICE_MARKUP.escape(
                        interface.enrich_tool_result(
                            result, str(call.name), self.tool_names, self.config.tool_feedback_evolution
                        )
                    )
            results.append(text)
        self._kept_bytes -= room  # _keeps reserved max_reply_bytes for the results: only what they kept stays charged
        state_error = self._check_state(record, first)
        contents = clip_texts(prompts.tool_result_messages(results, mode), self.limits.max_reply_bytes)
        contents[-1] += state_error
        error_type = STEP_BUDGET_EXCEEDED if over or state_error else STEP_TOOL_ERROR if tool_errors else None
        return self._reply(
            contents[0],
            extra=tuple(contents[1:]),
            role=prompts.tool_result_role(mode),
            framed=True,  # each result escaped before its framing (render_tool_result)
            error_type=error_type,
            num_calls=len(calls),
            num_tool_errors=tool_errors,
            num_over_budget=over,
        )

    def _next_user_turn(self) -> StepResult:
        """Reveal, completion, or the next question."""
        next_turn = self._turn + 1
        holdout = self.task.holdout_functions.get(next_turn)
        if holdout is not None:
            revealed = self._reveal(holdout)
            self._start_turn(next_turn)
            return self._reply(prompts.reveal_message(holdout), advanced=True, revealed_tools=revealed)
        if next_turn >= len(self.task.question):
            self._terminated = True
            return self._reply(prompts.CONVERSATION_COMPLETED, terminated=True)
        self._start_turn(next_turn)
        return self._reply(_first_user_content(self.task.question[next_turn]), advanced=True)

    def _start_turn(self, turn: int) -> None:
        self._turn = turn
        self._records.append(TurnRecord(calls=[], exec_results=[]))

    def _reveal(self, docs: list[dict]) -> list[str]:
        """Make holdout docs callable (dedupe by name); the system prompt stays as it was, as released."""
        known = set(self.tool_names)
        added = []
        for doc in docs:
            name = _tool_name(doc)
            if name not in known:
                self._tools.append(doc)
                known.add(name)
                added.append(name)
        self._session.allowed = self._allowed_names()
        return added


__all__ = [
    "Episode",
    "StepResult",
]
