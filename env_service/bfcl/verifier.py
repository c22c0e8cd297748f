"""Episode verification: BFCL's multi-turn verdict, per-turn progress tags, paper labels, reward.

Everything is computed from ONE replay on fresh, isolated backends (one :class:`BackendSession` for the
model's calls, one for the ground truth), turn by turn with state carried across turns, exactly as
bfcl-eval's ``multi_turn_checker`` executes: per GT turn t, execute the model's accepted calls of turn t,
then the GT calls of turn t, then check.

Official verdict (``valid``; bfcl ``_evaluate_single_multi_turn_entry`` + ``multi_turn_checker``):
  the number of model turns must equal the number of GT turns (else ``multi_turn:force_terminated``);
  then, for each turn in order whose GT is non-empty: the model turn must be non-empty
  (``multi_turn:empty_turn_model_response``), the instance class sets equal, bfcl's ``state_checker``
  must pass (``multi_turn:instance_state_mismatch``) and bfcl's ``response_checker`` must find every GT
  result of the turn among all model results so far (``multi_turn:execution_response_mismatch``).
  The first failure's ``error_type`` is recorded. Turns with empty GT are not checked (bfcl 2026.3.23
  does not apply its irrelevance checker), but the model's calls there still change state. A turn tagged
  ``budget_exceeded`` fails the verdict (``multi_turn:budget_exceeded``): its state is whatever the stopped
  call left, so no comparison with the GT means anything.

The replay runs under the same budgets as the episode (:class:`~env_service.bfcl.config.ServiceLimits`): each
model call gets ``call_budget_s``, the whole replay ``evaluate_budget_s``; calls the episode already saw
stopped are not run again (their recorded text stands in), and model results are clipped to
``max_reply_bytes`` (a ground-truth result is at most 31 KB, so no verdict can change).

Progress tags (the released code's vocabulary, one per GT turn; model turns padded with empty turns when the
episode ended early, ``terminated_early``), first match wins:
  ``gt_error`` (a GT call could not be parsed/executed), ``budget_exceeded`` (a model call of the turn was
  stopped or skipped by a time budget or the state limit, when the episode ran or during this replay: the
  turn fails, and so does the verdict, whatever the GT of the turn), GT empty -> ``spurious_tool_call`` (model made
  a call) or ``correct_abstention``; ``empty_turn_model_response``; ``instance_mismatch``;
  ``state_mismatch``; ``response_mismatch`` (``checker_error`` if a checker raised); else ``pass``.
  The tags use fresh state, so they agree with the verdict (docs/upstream-differences.md).
  ``progress = passed / scorable`` (scorable = GT-non-empty turns),
  ``progress_with_irrelevance = (passed + passed_irrelevance) / (scorable + irrelevance)``.

Paper labels (the paper's Table 5), one per GT turn. A turn tagged ``pass`` or ``correct_abstention`` is
labelled ``pass``; ``gt_error`` / ``checker_error`` keep their tag as label (not a model failure, ignored
by A-Patch). Every other (failing) turn gets the first label whose evidence holds, in the paper's
priority order:

1. ``invalid_tool_call``: the turn had parser errors (``TurnRecord.parse_errors``), calls rejected as
   unavailable (``TurnRecord.rejected_calls``), or an accepted call to a name that is no tool of the
   task's classes.
2. ``argument_mismatch`` ("right tool, wrong arguments"): for some function X that the GT turn calls,
   either (a) a model call of X in this turn failed with an argument error (Python's unexpected /
   missing / repeated keyword messages, wrong positional count, ``name 'nan'``, refused non-JSON or
   invalid argument names, or a TypeError-style message such as "not supported between instances"),
   or (b) after matching the model's X calls to the GT's X calls on the values of X's required
   parameters (numbers compare numerically, otherwise type and value must agree), both an unmatched
   GT call and an unmatched model call of X remain.
3. ``state_mismatch``: the tag is ``state_mismatch`` or ``instance_mismatch``.
4. ``recovery_failure``: some model call of this turn returned an execution error (``Error during
   execution: ...``, a JSON object with an ``"error"`` key, or TradingBot's ``['Error: ...']``) and
   the turn still failed.
5. ``missing_tool_call``: the tag is ``empty_turn_model_response`` (no call, or the episode ended
   before this turn); or the model made fewer calls of some GT function than the GT turn; or the tag is
   ``spurious_tool_call``. The last choice: on an abstention turn the model acted when it should have
   answered or asked (a missing parameter, an unavailable function). Table 5 has no over-calling label;
   the closest is ``missing_tool_call``'s "answered too early", i.e. a wrong call/answer decision;
   ``response_mismatch`` is reserved for turns whose interaction looked fine.
6. ``response_mismatch``: every other failing turn (calls made and executed cleanly, verifier fails).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from env_service.bfcl import upstream
from env_service.bfcl.calls import ToolCall, parse_call_string
from env_service.bfcl.config import RewardConfig, ServiceLimits
from env_service.bfcl.executor import BackendSession, CallOverBudget, clip_text
from env_service.bfcl.tasks import Task, load_task
from env_service.vocabulary import (
    EXECUTION_ERROR_PREFIX,
    LABEL_ARGUMENT_MISMATCH,
    LABEL_INVALID_TOOL_CALL,
    LABEL_MISSING_TOOL_CALL,
    LABEL_PASS,
    LABEL_RECOVERY_FAILURE,
    LABEL_RESPONSE_MISMATCH,
    LABEL_STATE_MISMATCH,
    TAG_BUDGET_EXCEEDED,
    TAG_CHECKER_ERROR,
    TAG_CORRECT_ABSTENTION,
    TAG_EMPTY_TURN,
    TAG_GT_ERROR,
    TAG_INSTANCE_MISMATCH,
    TAG_PASS,
    TAG_RESPONSE_MISMATCH,
    TAG_SPURIOUS_TOOL_CALL,
    TAG_STATE_MISMATCH,
    is_execution_error,
)

# bfcl's error_type of a failed verdict (the ``multi_turn:*`` names are bfcl's; budget_exceeded is ours).
ERROR_FORCE_TERMINATED = "multi_turn:force_terminated"
ERROR_EMPTY_TURN = "multi_turn:empty_turn_model_response"
ERROR_STATE_MISMATCH = "multi_turn:instance_state_mismatch"
ERROR_RESPONSE_MISMATCH = "multi_turn:execution_response_mismatch"
ERROR_CHECKER = "multi_turn:checker_error"
ERROR_GT = "multi_turn:gt_error"
ERROR_BUDGET = "multi_turn:budget_exceeded"

# Failing tag of a GT-non-empty turn -> bfcl error_type of the verdict. instance_mismatch is an
# AssertionError inside bfcl (unreachable: both sides load the same classes); we report it as a state
# mismatch.
_VERDICT_ERROR = {
    TAG_EMPTY_TURN: ERROR_EMPTY_TURN,
    TAG_INSTANCE_MISMATCH: ERROR_STATE_MISMATCH,
    TAG_STATE_MISMATCH: ERROR_STATE_MISMATCH,
    TAG_RESPONSE_MISMATCH: ERROR_RESPONSE_MISMATCH,
    TAG_CHECKER_ERROR: ERROR_CHECKER,
    TAG_GT_ERROR: ERROR_GT,
    TAG_BUDGET_EXCEEDED: ERROR_BUDGET,
}
_TURN_OK = (TAG_PASS, TAG_CORRECT_ABSTENTION)

_ARGUMENT_ERROR = re.compile(
    r"unexpected keyword argument|missing \d+ required (?:positional|keyword-only) argument"
    r"|takes (?:from \d+ to )?\d+ positional arguments? but|got multiple values for argument"
    r"|keyword argument repeated|invalid argument name|non-JSON value|non-string key"
    r"|name '(?:nan|inf)' is not defined|not supported between instances of"
    r"|unsupported operand type|must be (?:str|int|float|real number|a real number)"
    r"|can only concatenate|object is not (?:iterable|subscriptable)|has no len\(\)"
    r"|argument of type '\w+' is not iterable"
)


# -- inputs -------------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    """Evidence from one user turn of an episode (one record per user turn the model saw).

    ``calls``: accepted calls in execution order. ``parse_errors``: parser error messages of this turn.
    ``rejected_calls``: calls refused before execution (tool not available). ``exec_results``:
    optional, what the episode observed; the verifier re-executes on fresh state, except the calls listed
    in ``over_budget``: indices into ``calls`` that a budget stopped or skipped (their ``exec_results``
    text is what the replay uses; the turn is tagged ``budget_exceeded``).
    """

    calls: list[ToolCall]
    parse_errors: list[str] = field(default_factory=list)
    rejected_calls: list[ToolCall] = field(default_factory=list)
    exec_results: list[str] | None = None
    over_budget: list[int] = field(default_factory=list)


# -- outputs ------------------------------------------------------------------------------------


@dataclass
class Evaluation:
    task_id: str
    category: str
    valid: bool
    reward: float
    error_type: str | None
    error_turn: int | None
    tags: list[str]
    labels: list[str]
    progress: float
    progress_with_irrelevance: float
    passed_turns: int
    scorable_turns: int
    irrelevance_turns: int
    passed_irrelevance_turns: int
    terminated_early: bool
    num_model_turns: int
    num_gt_turns: int
    exec_errors: int

    def to_dict(self) -> dict:
        return asdict(self)


# -- helpers ------------------------------------------------------------------------------------


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def _same_value(a: Any, b: Any) -> bool:
    """JSON-kind-aware equality: ints and floats compare numerically, bools/strings/containers by kind."""
    numeric = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numeric) and isinstance(b, numeric):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def _required_parameters(task: Task) -> dict[str, list[str]]:
    docs = list(task.functions) + [doc for docs in task.holdout_functions.values() for doc in docs]
    return {doc["name"]: list(doc.get("parameters", {}).get("required", [])) for doc in docs}


@dataclass
class _Turn:
    """What the replay saw in one GT turn."""

    record: TurnRecord
    gt_calls: list[ToolCall]
    model_results: list[str]
    tag: str


def over_budget_text(why: str) -> str:
    """The result text of a call a budget stopped or skipped (an execution error, like bfcl's)."""
    return f"{EXECUTION_ERROR_PREFIX}{why}"


class _ReplayBudget:
    """The replay's clock: each model call gets ``call_budget_s``, all of them ``evaluate_budget_s``."""

    def __init__(self, limits: ServiceLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.evaluate_budget_s

    def run(self, session: BackendSession, record: TurnRecord, index: int) -> tuple[str, bool]:
        """(result, over budget) of the model's call ``index`` of ``record``."""
        if index in record.over_budget:
            recorded = record.exec_results or []
            return (recorded[index] if index < len(recorded) else over_budget_text("stopped by a budget")), True
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            why = f"not replayed: the evaluation used up its {self.limits.evaluate_budget_s:g} s"
            return over_budget_text(why), True
        try:
            result = session.execute(
                record.calls[index], min(self.limits.call_budget_s, remaining), self.limits.call_memory_mib * 2**20
            )
        except CallOverBudget as stopped:
            return over_budget_text(str(stopped)), True
        return clip_text(result, self.limits.max_reply_bytes), False


def _pad(turns: list[TurnRecord], n: int) -> list[TurnRecord]:
    return list(turns[:n]) + [TurnRecord(calls=[]) for _ in range(n - len(turns))]


def _replay(task: Task, turns: list[TurnRecord], limits: ServiceLimits) -> tuple[list[_Turn], frozenset[str]]:
    model = BackendSession(task)
    truth = BackendSession(task)
    budget = _ReplayBudget(limits)
    try:
        tool_names = model.tool_names
        all_model_results: list[str] = []
        replayed: list[_Turn] = []
        for turn_index, (gt_strings, record) in enumerate(zip(task.ground_truth, _pad(turns, len(task.ground_truth)))):
            outcomes = [budget.run(model, record, i) for i in range(len(record.calls))]
            model_results = [result for result, _ in outcomes]
            all_model_results.extend(model_results)
            try:
                gt_calls = [parse_call_string(s, task) for s in gt_strings]
                gt_results = [truth.execute(call) for call in gt_calls]
            except Exception:  # a broken GT entry must not crash training
                replayed.append(_Turn(record, [], model_results, TAG_GT_ERROR))
                continue
            if any(over for _, over in outcomes):
                replayed.append(_Turn(record, gt_calls, model_results, TAG_BUDGET_EXCEEDED))
                continue
            tag = _turn_tag(turn_index, record, gt_calls, gt_results, all_model_results, model, truth)
            replayed.append(_Turn(record, gt_calls, model_results, tag))
        return replayed, tool_names
    finally:
        model.close()
        truth.close()


def _turn_tag(
    turn_index: int,
    record: TurnRecord,
    gt_calls: list[ToolCall],
    gt_results: list[str],
    all_model_results: list[str],
    model: BackendSession,
    truth: BackendSession,
) -> str:
    if not gt_calls:
        return TAG_SPURIOUS_TOOL_CALL if record.calls else TAG_CORRECT_ABSTENTION
    if not record.calls:
        return TAG_EMPTY_TURN
    model_instances, gt_instances = dict(model.instances), dict(truth.instances)
    if not gt_instances or set(model_instances) != set(gt_instances):
        return TAG_INSTANCE_MISMATCH
    try:
        if not upstream.state_checker(model_instances, gt_instances)["valid"]:
            return TAG_STATE_MISMATCH
        if not upstream.response_checker(all_model_results, gt_results, turn_index)["valid"]:
            return TAG_RESPONSE_MISMATCH
    except Exception:
        return TAG_CHECKER_ERROR
    return TAG_PASS


def _verdict(replayed: list[_Turn], num_model_turns: int) -> tuple[bool, str | None, int | None]:
    if num_model_turns != len(replayed):
        return False, ERROR_FORCE_TERMINATED, None
    for turn_index, turn in enumerate(replayed):
        # Empty-GT turns are skipped by bfcl: their tags are never in _VERDICT_ERROR, except budget_exceeded.
        if turn.tag in _VERDICT_ERROR:
            return False, _VERDICT_ERROR[turn.tag], turn_index
    return True, None, None


def _match_on_required(gt_calls: list[ToolCall], model_calls: list[ToolCall], required: list[str]) -> tuple[int, int]:
    """Greedy match on required-parameter values; returns (unmatched GT, unmatched model) counts."""
    remaining = list(model_calls)
    unmatched_gt = 0
    for gt_call in gt_calls:
        keys = [p for p in required if p in gt_call.arguments]
        for i, call in enumerate(remaining):
            if all(p in call.arguments and _same_value(call.arguments[p], gt_call.arguments[p]) for p in keys):
                del remaining[i]
                break
        else:
            unmatched_gt += 1
    return unmatched_gt, len(remaining)


def _argument_mismatch(turn: _Turn, required: dict[str, list[str]]) -> bool:
    gt_names = {call.name for call in turn.gt_calls}
    for call, result in zip(turn.record.calls, turn.model_results):
        argument_error = result.startswith(EXECUTION_ERROR_PREFIX) and _ARGUMENT_ERROR.search(result)
        if call.name in gt_names and argument_error:
            return True
    for name in gt_names:
        gt_of_name = [c for c in turn.gt_calls if c.name == name]
        model_of_name = [c for c in turn.record.calls if c.name == name]
        unmatched_gt, unmatched_model = _match_on_required(gt_of_name, model_of_name, required.get(name, []))
        if unmatched_gt and unmatched_model:
            return True
    return False


def _fewer_calls_than_gt(turn: _Turn) -> bool:
    model_counts = Counter(call.name for call in turn.record.calls)
    return any(model_counts[name] < n for name, n in Counter(c.name for c in turn.gt_calls).items())


def _turn_label(turn: _Turn, tool_names: frozenset[str], required: dict[str, list[str]]) -> str:
    if turn.tag in _TURN_OK:
        return LABEL_PASS
    if turn.tag in (TAG_GT_ERROR, TAG_CHECKER_ERROR):
        return turn.tag
    record = turn.record
    if record.parse_errors or record.rejected_calls or any(c.name not in tool_names for c in record.calls):
        return LABEL_INVALID_TOOL_CALL
    if _argument_mismatch(turn, required):
        return LABEL_ARGUMENT_MISMATCH
    if turn.tag in (TAG_STATE_MISMATCH, TAG_INSTANCE_MISMATCH):
        return LABEL_STATE_MISMATCH
    if any(is_execution_error(result) for result in turn.model_results):
        return LABEL_RECOVERY_FAILURE
    if turn.tag in (TAG_EMPTY_TURN, TAG_SPURIOUS_TOOL_CALL) or _fewer_calls_than_gt(turn):
        return LABEL_MISSING_TOOL_CALL
    return LABEL_RESPONSE_MISMATCH


# -- public API -----------------------------------------------------------------------------------


def evaluate_episode(
    task: Task, turns: list[TurnRecord], reward: RewardConfig | None = None, limits: ServiceLimits | None = None
) -> Evaluation:
    """Verdict, tags, labels, progress and reward of one episode (see the module docstring)."""
    turns = list(turns)
    replayed, tool_names = _replay(task, turns, limits if limits is not None else ServiceLimits())
    valid, error_type, error_turn = _verdict(replayed, len(turns))
    required = _required_parameters(task)

    tags = [turn.tag for turn in replayed]
    scorable = [t for t in replayed if t.gt_calls or t.tag == TAG_GT_ERROR]
    irrelevance = [t for t in replayed if not t.gt_calls and t.tag != TAG_GT_ERROR]
    passed = sum(t.tag == TAG_PASS for t in scorable)
    passed_irrelevance = sum(t.tag == TAG_CORRECT_ABSTENTION for t in irrelevance)
    denominator = len(scorable) + len(irrelevance)

    evaluation = Evaluation(
        task_id=task.id,
        category=task.category,
        valid=valid,
        reward=0.0,
        error_type=error_type,
        error_turn=error_turn,
        tags=tags,
        labels=[_turn_label(turn, tool_names, required) for turn in replayed],
        progress=passed / len(scorable) if scorable else 0.0,
        progress_with_irrelevance=(passed + passed_irrelevance) / denominator if denominator else 0.0,
        passed_turns=passed,
        scorable_turns=len(scorable),
        irrelevance_turns=len(irrelevance),
        passed_irrelevance_turns=passed_irrelevance,
        terminated_early=len(turns) < len(replayed),
        num_model_turns=len(turns),
        num_gt_turns=len(replayed),
        exec_errors=sum(is_execution_error(r) for t in replayed for r in t.model_results),
    )
    evaluation.reward = reward_from(evaluation, reward if reward is not None else RewardConfig())
    return evaluation


def reward_from(evaluation: Evaluation, cfg: RewardConfig) -> float:
    """Scalar reward: binary verdict, capped partial credit, or T3RL-style credit."""
    if evaluation.valid:
        return 1.0
    if cfg.mode == "binary":
        return 0.0
    if cfg.mode == "capped":
        weight = max(0.0, float(cfg.partial_credit_weight))
        return _clamp01(min(cfg.partial_credit_cap, weight * _clamp01(evaluation.progress)))
    # t3rl
    if cfg.scorable_floor and evaluation.scorable_turns > 0 and evaluation.passed_turns == 0:
        return 0.0
    w = float(cfg.irrelevance_weight)
    denominator = evaluation.scorable_turns + w * evaluation.irrelevance_turns
    if denominator > 0:
        return _clamp01((evaluation.passed_turns + w * evaluation.passed_irrelevance_turns) / denominator)
    return _clamp01(evaluation.progress_with_irrelevance or evaluation.progress)


def _parse_record_turns(raw_turns: Any, record_id: str) -> list[TurnRecord]:
    if not isinstance(raw_turns, list):
        raise ValueError(f"{record_id}: 'turns' must be a list of turns")
    turns = []
    for t, raw_turn in enumerate(raw_turns):
        if not isinstance(raw_turn, list):
            raise ValueError(f"{record_id}: turn {t} must be a list of calls")
        calls = []
        for c, raw_call in enumerate(raw_turn):
            if (
                not isinstance(raw_call, dict)
                or not isinstance(raw_call.get("name"), str)
                or not isinstance(raw_call.get("arguments", {}), dict)
            ):
                raise ValueError(f'{record_id}: turn {t} call {c} must be {{"name": str, "arguments": object}}')
            calls.append(ToolCall(name=raw_call["name"], arguments=raw_call.get("arguments", {})))
        turns.append(TurnRecord(calls=calls))
    return turns


def score_record(record: dict) -> dict:
    """CLI ``score``: ``{"id", "turns": [[{"name","arguments"},...],...]}`` -> verdict summary."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or "turns" not in record:
        raise ValueError('a score record must be a JSON object with "id" (str) and "turns"')
    record_id = record["id"]
    try:
        task = load_task(record_id)
    except KeyError as error:
        raise ValueError(str(error.args[0])) from None
    evaluation = evaluate_episode(task, _parse_record_turns(record["turns"], record_id))
    return {
        "id": record_id,
        "valid": evaluation.valid,
        "tags": evaluation.tags,
        "labels": evaluation.labels,
        "progress": evaluation.progress,
    }


def evaluate_calls(task: Task, turns: Iterable[Iterable[ToolCall]], reward: RewardConfig | None = None) -> Evaluation:
    """Convenience: evaluate plain per-turn call lists (no parser/rejection evidence)."""
    return evaluate_episode(task, [TurnRecord(calls=list(calls)) for calls in turns], reward)
