"""Rollout backend ``scripted``: a generation server that answers at once with realistic turns, for measuring the
rest of the rollout path (verl's agent-loop manager and workers, ``BfclAgentLoop``, the environment service) at a
GPU recipe's concurrency on a machine that cannot generate that fast (``scripts/production_shape.py``).

It plugs into verl's rollout registries as ``hf`` does (``seal/verl_plugins.py``: ``rollout.name=scripted``) and
sits behind the same interface: token ids in, token ids out. What it answers is a function of the prompt alone (verl
gives every turn a fresh request id, so nothing per episode can be kept): it finds the task by the episode's first
user message, the turn by the environment's last message (a user or tool-result message), and answers like a model
that mostly knows the ground truth (``env_service/replay.py``'s messages), with set shares of realistic mistakes
(``ScriptConfig``):

* at a turn's question: the turn's ground-truth calls, some with one wrong argument; or a malformed call; or no call
  at all (an early stop); a turn whose ground truth has no call gets the text that moves on;
* after the environment's reply to calls: the text that ends the turn, or first an extra call;
* at any turn, a share of rambles: the answer goes on past the request's ``max_tokens`` and is cut there, without
  its end-of-turn token, as vLLM cuts a generation at its length limit (and reports it ``completed``, as verl's
  vLLM server does for ``length``).

Its choices are drawn from the request's sampling seed (training samples are seeded by their step, attempt and
call: ``seal/resume.py``), else from the prompt, so a rerun answers the same. It never runs a model: the update that
follows a rollout (``hf`` or vLLM's weights) is the trainer's business, and weight syncs are accepted and dropped.
"""

from __future__ import annotations

import difflib
import random
import zlib
from dataclasses import dataclass, fields
from typing import Any

from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput

from seal.cpu.hf_rollout import IdleServer, _model_path, server_actor_name

ROLLOUT_NAME = "scripted"
#: The roles of what the environment says: the user (Qwen's tool results too) and Llama 3.1's tool results
#: (``ipython``), so the script reads a tool result as the latest message, not the question before it.
ENVIRONMENT_ROLES = ("user", "ipython")
#: What a rambling answer repeats until its length limit cuts it.
RAMBLE = " Let me check that once more before I answer."


@dataclass(frozen=True)
class ScriptConfig:
    """``actor_rollout_ref.rollout.custom.scripted`` (verl's extension point for a backend's own settings).

    Shares are per decision: ``wrong_argument`` and ``malformed`` of the messages that carry a turn's calls,
    ``early_stop`` of the turns that have calls, ``extra_call`` of the replies to calls, ``length_cut`` of every
    answer."""

    wrong_argument: float = 0.10
    malformed: float = 0.03
    early_stop: float = 0.05
    extra_call: float = 0.05
    length_cut: float = 0.02
    tool_prompt_mode: str = "bfcl_qwen_fc"  # the syntax of the calls (env_service.bfcl.tool_prompt_mode)
    turn_start_token: str = (
        "<|im_start|>"  # what starts a chat message in the template (Llama 3.1: <|start_header_id|>)
    )
    end_of_turn_token: str = "<|im_end|>"  # what ends an answer (seal.rollout.end_of_turn_token)

    @classmethod
    def from_rollout_config(cls, rollout) -> ScriptConfig:
        custom = (getattr(rollout, "custom", None) or {}).get(ROLLOUT_NAME) or {}
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(custom) - set(names))
        if unknown:
            hints = [
                f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, names, 1)) else key
                for key in unknown
            ]
            raise ValueError(f"rollout.custom.scripted: unknown keys {', '.join(hints)}; its keys: {', '.join(names)}")
        return cls(**custom)


@dataclass(frozen=True)
class Turn:
    """Where an episode stands, read from its prompt: its task, and which question the last user message asks
    (``None``: the last message answers the model's calls)."""

    task: Any
    question: int | None
    current: int  # the latest question asked so far


class ScriptedServer(IdleServer):
    """The token-in/token-out server (a Ray actor in training, a plain object in tests)."""

    def __init__(self, model_path: str, config: ScriptConfig | None = None, replica_rank: int = 0):
        from transformers import AutoTokenizer

        from env_service.bfcl.tasks import load_task, task_ids

        super().__init__()
        self.config = config or ScriptConfig()
        self.replica_rank = replica_rank
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.turn_start = self.tokenizer.convert_tokens_to_ids(self.config.turn_start_token)
        self.end_of_turn = self.tokenizer.convert_tokens_to_ids(self.config.end_of_turn_token)
        self.ramble = self.tokenizer.encode(RAMBLE, add_special_tokens=False)
        # every task of the release (train and held-out), by its first question
        self.by_question: dict[str, list] = {}
        for task_id in task_ids("train") + task_ids("heldout"):
            task = load_task(task_id)
            self.by_question.setdefault(_question(task, 0), []).append(task)
        self.answers = 0

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str | None = None,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """verl's server entry point (called by LLMServerClient.generate)."""
        return self.answer(list(prompt_ids), dict(sampling_params or {}))

    def answer(self, prompt_ids: list[int], params: dict[str, Any]) -> TokenOutput:
        turn = self.read(prompt_ids)
        rng = random.Random(params["seed"] if params.get("seed") is not None else zlib.crc32(repr(prompt_ids).encode()))
        ids = self.tokenizer.encode(self.script(turn, rng), add_special_tokens=False) + [self.end_of_turn]
        limit = int(params.get("max_tokens") or len(ids))
        if rng.random() < self.config.length_cut:  # a ramble that runs into the length limit
            ids = ids[:-1] + self.ramble * (limit // len(self.ramble) + 1)
        ids = ids[:limit]
        self.answers += 1
        return TokenOutput(
            token_ids=ids,
            log_probs=[0.0] * len(ids) if params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

    # ---- reading the prompt -----------------------------------------------------------------------

    def read(self, prompt_ids: list[int]) -> Turn:
        """The episode's task (by its first user message) and turn (by the latest environment message with a
        question of that task), decoding only those messages: the prompt is the whole context, up to tens of
        thousands of tokens, and every turn of every episode comes here."""
        spans = self._spans(prompt_ids)
        users = [span for span in spans if self._role(prompt_ids, span) in ENVIRONMENT_ROLES]
        first = self._content(prompt_ids, users[0]) if users else ""
        if first not in self.by_question:
            raise ValueError("scripted rollout: the prompt's first user message is no BFCL task's first question")
        tasks = self.by_question[first]
        task = tasks[0] if len(tasks) == 1 else _best_match(tasks, self._content(prompt_ids, spans[0]))
        for position, span in enumerate(reversed(users)):
            text = self._content(prompt_ids, span)
            asked = next((i for i in reversed(range(len(task.question))) if _opening(task, i) in text), None)
            if asked is not None:
                return Turn(task, asked if position == 0 else None, asked)
        raise ValueError(f"scripted rollout: no question of {task.id} in the prompt")

    def _spans(self, prompt_ids: list[int]) -> list[tuple[int, int]]:
        """(start, end) of every message of the prompt, cut at the template's message-start token."""
        starts = [i for i, token in enumerate(prompt_ids) if token == self.turn_start] + [len(prompt_ids)]
        return list(zip(starts, starts[1:]))

    def _role(self, prompt_ids: list[int], span: tuple[int, int]) -> str:
        head = self.tokenizer.decode(prompt_ids[span[0] + 1 : min(span[0] + 6, span[1])], skip_special_tokens=True)
        return head.split("\n", 1)[0].strip()

    def _content(self, prompt_ids: list[int], span: tuple[int, int]) -> str:
        text = self.tokenizer.decode(prompt_ids[span[0] + 1 : span[1]], skip_special_tokens=True)
        return text.partition("\n")[2].strip()

    # ---- answering ------------------------------------------------------------------------------------

    def script(self, turn: Turn, rng: random.Random) -> str:
        from env_service.bfcl.calls import parse_call_string
        from env_service.replay import ADVANCE_TEXT, calls_message

        config = self.config
        if turn.question is None:  # the environment answered calls: end the turn, or call once more
            truth = turn.task.ground_truth[turn.current]
            if truth and rng.random() < config.extra_call:
                return calls_message([parse_call_string(rng.choice(truth), turn.task)], config.tool_prompt_mode)
            return ADVANCE_TEXT
        truth = turn.task.ground_truth[turn.question]
        if not truth or rng.random() < config.early_stop:
            return ADVANCE_TEXT
        if rng.random() < config.malformed:
            return '<tool_call>\n{"name": "' + truth[0].split("(", 1)[0] + '", "arguments": {'
        calls = [parse_call_string(call, turn.task) for call in truth]
        if rng.random() < config.wrong_argument:
            _mistake(rng.choice(calls).arguments, rng)
        return calls_message(calls, config.tool_prompt_mode)

    # ---- weights: there is no model -------------------------------------------------------------------

    async def load_weights(self, weights) -> dict:
        return {"loaded": len(dict(weights.items() if isinstance(weights, dict) else weights))}


class FixedReplies:
    """verl's server-manager ``generate`` answering each call with the next of a fixed list of messages (a plain
    "Done." once they are used up), for the agent loop run outside verl's workers (``BfclAgentLoop.outside_workers``:
    tests and benchmarks). Each message is tokenized as a model writes it, markup such as ``<tool_call>`` as its added
    token (with ``ordinary``, every character an ordinary token: a model can write a control string's text piece by
    piece), then the end-of-turn token ``end``; every token's log-prob is ``LOG_PROB``. ``prompts``: what each call was
    shown."""

    LOG_PROB = -0.5

    def __init__(self, tokenizer, messages: list[str], end: str = "<|im_end|>", ordinary: bool = False):
        self.tokenizer, self.messages, self.ordinary = tokenizer, list(messages), ordinary
        self.end = tokenizer.convert_tokens_to_ids(end)
        self.prompts: list[list[int]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.prompts.append(list(prompt_ids))
        text = self.messages.pop(0) if self.messages else "Done."
        ids = self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=self.ordinary) + [self.end]
        return TokenOutput(token_ids=ids, log_probs=[self.LOG_PROB] * len(ids))


def _question(task, turn: int) -> str:
    """The text the environment opens ``task``'s ``turn`` with: its question, or for a missing-function turn (no
    question) the message that reveals the functions."""
    from env_service.bfcl.prompts import reveal_message

    text = "\n".join(message["content"] for message in task.question[turn]).strip()
    if not text and turn in task.holdout_functions:
        text = reveal_message(task.holdout_functions[turn])
    return text


def _opening(task, turn: int) -> str:
    """The start of :func:`_question`: what survives the agent loop's clipping of long environment messages
    (``seal.rollout.max_env_tokens``; a reveal message lists whole function docs)."""
    return _question(task, turn)[:OPENING_CHARS]


#: Characters of a turn's opening message that identify the turn.
OPENING_CHARS = 160


def _best_match(tasks: list, prompt: str):
    """Of tasks sharing a first question (a category's variants of one scenario), the one whose tools the prompt
    shows: the most of its functions present and the fewest absent (a miss_func variant holds some back)."""

    def score(task) -> int:
        names = [doc["name"] for doc in task.functions]
        return sum(f'"{name}"' in prompt for name in names) * 2 - len(names)

    return max(tasks, key=score)


def _mistake(arguments: dict, rng: random.Random) -> None:
    """One argument made wrong the way a model gets one wrong: another string, number or flag, an item dropped."""
    if not arguments:
        return
    key = rng.choice(sorted(arguments))
    value = arguments[key]
    if isinstance(value, bool):
        arguments[key] = not value
    elif isinstance(value, (int, float)):
        arguments[key] = value + 1
    elif isinstance(value, str):
        arguments[key] = value + "_1" if value else "x"
    elif isinstance(value, list) and value:
        arguments[key] = value[:-1]
    else:
        arguments[key] = None


class ScriptedReplica(RolloutReplica):
    """One scripted server per replica; it needs no device, so standalone it takes no resource pool either."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self):
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def launch_servers(self):
        import ray

        # named as hf's: in hybrid mode hf's adapter (HFRolloutAdapter) finds it and hands it the weights it drops
        name = server_actor_name(self.replica_rank, suffix=self.name_suffix)
        server = (
            ray.remote(ScriptedServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(_model_path(self.model_config), ScriptConfig.from_rollout_config(self.config), self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = name
