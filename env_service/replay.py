"""Ground-truth replay through the full episode mechanics (parser, availability checks, executor, turn
logic, verifier), shared by the CLI ``replay`` command, benchmarks and tests.

For each user turn the "model" emits the turn's GT calls as one message in the prompt mode's own syntax
(``<tool_call>`` JSON blocks, or a Python call list), with positional GT arguments bound to parameter
names, then a plain-text message to move on. A correct environment scores every task as passed, except
the tasks listed in :data:`UNSOLVABLE_WITH_ENFORCED_TOOLS`.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field

from env_service.bfcl.calls import ToolCall, parse_call_string
from env_service.bfcl.config import EnvConfig
from env_service.bfcl.episode import Episode
from env_service.bfcl.tasks import CATEGORIES, Task, load_task, parse_task_id
from env_service.bfcl.verifier import Evaluation, evaluate_episode
from env_service.client import EnvServiceError
from env_service.vocabulary import ERROR_MARKER

#: The plain-text message that ends a turn during replay.
ADVANCE_TEXT = "Done."

#: Tasks whose ground truth cannot pass while ``enforce_available_tools`` is on (found by replaying all
#: 800 tasks; ``tests/env/test_episode.py`` re-derives the list from the data). Task id -> reason.
UNSOLVABLE_WITH_ENFORCED_TOOLS: dict[str, str] = {
    "multi_turn_miss_func_49": (
        "GT turn 1 calls `tail`, which is held out (with `wc` and `cat`) until turn 3: the call is rejected "
        "as not available in the current tool list, and no available tool yields tail's result, so turn 1 "
        "cannot pass the response check"
    ),
}


def _tool_call_block(call: ToolCall) -> str:
    payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def _python_call(call: ToolCall) -> str:
    # repr() of JSON values is a Python literal that ast.literal_eval reads back identically.
    args = ", ".join(f"{key}={value!r}" for key, value in call.arguments.items())
    return f"{call.name}({args})"


def calls_message(calls: list[ToolCall], prompt_mode: str = "bfcl_qwen_fc") -> str:
    """One assistant message carrying ``calls`` in the syntax ``prompt_mode`` asks the model for."""
    if prompt_mode == "toolace_llama":
        return "[" + ", ".join(_python_call(call) for call in calls) + "]"
    return "\n".join(_tool_call_block(call) for call in calls)


def ground_truth_messages(task: Task, prompt_mode: str = "bfcl_qwen_fc") -> list[str]:
    """The assistant messages of a GT replay, in order: per turn, the calls (if any), then ADVANCE_TEXT."""
    messages = []
    for turn in task.ground_truth:
        calls = [parse_call_string(call, task) for call in turn]
        if calls:
            messages.append(calls_message(calls, prompt_mode))
        messages.append(ADVANCE_TEXT)
    return messages


@dataclass
class ReplayTrace:
    """What happened during a replay: the evaluation plus every environment reply."""

    evaluation: Evaluation
    replies: list[dict] = field(default_factory=list)  # StepResult.message per step
    infos: list[dict] = field(default_factory=list)  # StepResult.info per step
    terminated: bool = False

    @property
    def rejections(self) -> list[str]:
        """The ``[ERROR] ...`` replies (empty for a clean replay)."""
        return [reply["content"] for reply in self.replies if reply["content"].startswith(ERROR_MARKER)]


def trace_ground_truth(task: Task, config: EnvConfig | None = None, mode: str = "validate") -> ReplayTrace:
    """Replay the GT through an :class:`Episode` and keep every reply (see the module docstring)."""
    config = config if config is not None else EnvConfig()
    episode = Episode(task, mode, config)
    replies, infos = [], []
    try:
        episode.initial_messages()
        for text in ground_truth_messages(task, config.tool_prompt_mode):
            if episode.terminated:
                break
            result = episode.step(text)
            replies.append(result.message)
            infos.append(result.info)
        evaluation = evaluate_episode(task, episode.turn_records, config.reward)
        return ReplayTrace(evaluation, replies, infos, episode.terminated)
    finally:
        episode.close()


def replay_ground_truth(task: Task, config: EnvConfig | None = None, mode: str = "validate") -> Evaluation:
    """The verifier's :class:`Evaluation` of a GT replay (``valid`` is True for a solvable task)."""
    return trace_ground_truth(task, config, mode).evaluation


# ---------------------------------------------------------------------------------------------
# Ground-truth replay through full episode mechanics, over any client (in-process or HTTP)
# ---------------------------------------------------------------------------------------------

#: Tasks expected to fail a GT replay under a given config (see ``expected_failures``).
EXPECTED_FAILURES = UNSOLVABLE_WITH_ENFORCED_TOOLS


def expected_failures(params: dict | None = None) -> dict[str, str]:
    """Task id -> reason for the tasks whose GT cannot pass under ``params`` (the env config)."""
    config = EnvConfig.from_dict(params or {})
    return dict(UNSOLVABLE_WITH_ENFORCED_TOOLS) if config.enforce_available_tools else {}


@dataclass
class ReplayResult:
    """One replayed task. ``passed``: the service's verdict; ``error``: the replay itself failed."""

    task_id: str
    category: str
    passed: bool = False
    expected_failure: bool = False
    error: str | None = None
    error_type: str | None = None
    terminated: bool = False
    steps: int = 0
    seconds: float = 0.0
    evaluation: dict | None = None

    @property
    def unexpected(self) -> bool:
        """A failure that is neither a transport/episode error nor listed in EXPECTED_FAILURES."""
        return self.error is None and not self.passed and not self.expected_failure

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=4096)
def _cached_gt_messages(task_id: str, prompt_mode: str) -> tuple[str, ...]:
    # load_task deep-copies the task (~1-2 ms); the driver should cost nothing next to the service.
    return tuple(ground_truth_messages(load_task(task_id), prompt_mode))


def _category_of(task_id: str) -> str:
    try:
        return parse_task_id(task_id)[0]
    except ValueError:
        return "unknown"


#: ``ReplayResult.error`` of the tasks not attempted because the service had stopped answering.
SKIPPED_UNREACHABLE = "skipped: the service stopped answering"


def replay_task(
    client,
    task_id: str,
    mode: str = "validate",
    params: dict | None = None,
    service_gone: threading.Event | None = None,
) -> ReplayResult:
    """Create, replay every GT message, evaluate and release one episode (release also on errors).

    ``client``: anything with the ``env_service.client`` interface (in-process or HTTP).
    ``service_gone``: set here when the service is unreachable (the client's retries are spent);
    once set, tasks are skipped instead of each spending the retries again.
    """
    started = time.perf_counter()
    params = params or {}
    result = ReplayResult(task_id, _category_of(task_id))
    if service_gone is not None and service_gone.is_set():
        result.error = SKIPPED_UNREACHABLE
        return result
    instance_id = None
    try:
        result.expected_failure = task_id in expected_failures(params)
        messages = _cached_gt_messages(task_id, EnvConfig.from_dict(params).tool_prompt_mode)
        instance_id = client.create(task_id, mode, params)["instance_id"]
        for text in messages:
            step = client.step(instance_id, text)
            result.steps += 1
            if step["terminated"]:
                result.terminated = True
                break
        evaluation = client.evaluate(instance_id, release=True)
        instance_id = None  # released with the evaluation
        result.evaluation = evaluation
        result.passed = bool(evaluation.get("valid")) and result.terminated
        result.error_type = evaluation.get("error_type") or (None if result.terminated else "replay:not_terminated")
    except (EnvServiceError, ValueError, KeyError) as error:
        result.error = f"{type(error).__name__}: {error}"
        if isinstance(error, EnvServiceError) and error.status is None and service_gone is not None:
            service_gone.set()
            instance_id = None  # no one to release it with
    finally:
        if instance_id is not None:
            try:
                client.release(instance_id)
            except Exception:  # noqa: BLE001 - the service reclaims it later anyway
                pass
        result.seconds = time.perf_counter() - started
    return result


def replay_split(
    client,
    task_ids: list[str],
    concurrency: int = 1,
    mode: str = "validate",
    params: dict | None = None,
    progress: bool = False,
) -> list[ReplayResult]:
    """Replay many tasks with ``concurrency`` threads; results in the order of ``task_ids``.

    Once the service is unreachable, the remaining tasks are skipped (error ``SKIPPED_UNREACHABLE``).
    """
    bar = _progress_bar(len(task_ids), progress)
    results: list[ReplayResult | None] = [None] * len(task_ids)
    gone = threading.Event()
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            futures = {pool.submit(replay_task, client, t, mode, params, gone): i for i, t in enumerate(task_ids)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
    finally:
        bar.close()
    return [r for r in results if r is not None]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="ep", desc="replay", file=sys.stderr, dynamic_ncols=True)


def summarize(results: list[ReplayResult]) -> dict:
    """Per-category and total counts, the failing ids, and ``ok`` (no errors, no unexpected failures)."""
    categories: dict[str, dict] = {}
    for r in results:
        row = categories.setdefault(
            r.category, {"tasks": 0, "passed": 0, "expected_failures": 0, "unexpected_failures": 0, "errors": 0}
        )
        row["tasks"] += 1
        row["passed"] += r.passed
        row["expected_failures"] += not r.passed and r.error is None and r.expected_failure
        row["unexpected_failures"] += r.unexpected
        row["errors"] += r.error is not None
    order = {c: i for i, c in enumerate(CATEGORIES)}
    categories = dict(sorted(categories.items(), key=lambda kv: order.get(kv[0], len(order))))
    total = {
        key: sum(row[key] for row in categories.values())
        for key in ("tasks", "passed", "expected_failures", "unexpected_failures", "errors")
    }
    seconds = sum(r.seconds for r in results)
    return {
        "categories": categories,
        "total": total,
        "failing": [
            {
                "task_id": r.task_id,
                "expected": r.expected_failure and r.error is None,
                "error": r.error is not None,
                "reason": r.error or r.error_type or "failed",
                **({"note": EXPECTED_FAILURES[r.task_id]} if r.expected_failure else {}),
            }
            for r in results
            if not r.passed
        ],
        "mean_episode_s": seconds / len(results) if results else 0.0,
        "ok": total["errors"] == 0 and total["unexpected_failures"] == 0,
    }


def format_report(report: dict) -> str:
    """A plain-text pass table plus the failing ids (stable output: no colours, no widths from a tty)."""
    header = f"{'category':<14}{'tasks':>7}{'passed':>8}{'rate':>8}{'expected':>10}{'unexpected':>12}{'errors':>8}"
    lines = [header, "-" * len(header)]

    def row(name: str, r: dict) -> str:
        rate = 100.0 * r["passed"] / r["tasks"] if r["tasks"] else 0.0
        return (
            f"{name:<14}{r['tasks']:>7}{r['passed']:>8}{rate:>7.1f}%{r['expected_failures']:>10}"
            f"{r['unexpected_failures']:>12}{r['errors']:>8}"
        )

    for name, r in report["categories"].items():
        lines.append(row(name, r))
    lines.append("-" * len(header))
    lines.append(row("total", report["total"]))
    if report["failing"]:
        lines.append("")
        lines.append("failing tasks:")
        for f in report["failing"]:
            tag = "expected" if f["expected"] else "ERROR" if f.get("error") else "UNEXPECTED"
            lines.append(f"  {f['task_id']}  [{tag}] {f['reason']}" + (f" — {f['note']}" if f.get("note") else ""))
    lines.append("")
    lines.append("result: " + ("OK" if report["ok"] else "FAILED"))
    return "\n".join(lines)


__all__ = [
    "ADVANCE_TEXT",
    "EXPECTED_FAILURES",
    "SKIPPED_UNREACHABLE",
    "ReplayResult",
    "expected_failures",
    "format_report",
    "replay_split",
    "replay_task",
    "summarize",
    "UNSOLVABLE_WITH_ENFORCED_TOOLS",
    "ReplayTrace",
    "calls_message",
    "ground_truth_messages",
    "replay_ground_truth",
    "trace_ground_truth",
]
