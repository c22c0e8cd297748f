"""Chaos tests against a real service with two worker processes: hostile messages cost at most their budget.

One service (loopback, ephemeral port, small budgets so the tests stay short) is shared by the module:

* file-system copies and moves that alias directories make ``find`` / ``du`` exponential (2**40 entries
  here): the call is stopped at its budget, the model reads why, the verifier tags the turn
  ``budget_exceeded``, and an innocent episode stepping at the same time is not held up beyond the budget;
* each MathAPI argument shape that runs in C code for minutes is refused at once;
* a flood of ``cat`` replies is truncated with a marker;
* a worker that is killed is replaced and its episodes go on; one that stops answering is replaced, only the
  episode whose request it missed fails (``episode_lost``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from env_service import replay
from env_service.bfcl import tasks
from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient, EnvServiceError
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread
from tests.support.env_attacks import aliasing_messages, call, episodes_on_two_workers, worker_of

LIMITS = ServiceLimits(
    call_budget_s=0.5,
    message_budget_s=1.0,
    evaluate_budget_s=2.0,
    worker_grace_s=2.0,
    max_calls_per_message=40,
    max_steps=40,
)
SLACK_S = 4.0  # scheduling noise on a shared 2-core machine
FS_TASK = "multi_turn_base_0"  # GorillaFileSystem + TwitterAPI


@pytest.fixture(scope="module")
def service():
    manager = EpisodeManager(workers=2, limits=LIMITS)
    with ServerThread(manager) as server:
        yield server


@pytest.fixture()
def client(service):
    with EnvClient(service.url, retries=0, timeout_s=60) as c:
        yield c


def timed_step(client, instance_id: str, content: str) -> tuple[dict, float]:
    started = time.monotonic()
    result = client.step(instance_id, content)
    return result, time.monotonic() - started


def test_aliasing_traversal_costs_its_budget_and_spares_other_episodes(service, client):
    hostile = client.create(FS_TASK, "validate")["instance_id"]
    for message in aliasing_messages():
        result, _ = timed_step(client, hostile, message)
        assert result["info"]["num_tool_errors"] == 0, result["message"]["content"][:500]

    innocent_task = tasks.load_task("multi_turn_base_1")
    latencies: list[float] = []

    def innocent():
        with EnvClient(service.url, retries=0, timeout_s=60) as other:
            iid = other.create(innocent_task.id, "validate")["instance_id"]
            for message in replay.ground_truth_messages(innocent_task):
                latencies.append(timed_step(other, iid, message)[1])
            latencies.append(other.evaluate(iid, release=True)["valid"])

    thread = threading.Thread(target=innocent)
    thread.start()
    for traversal in (call("find", path="."), call("du", human_readable=True)):
        result, seconds = timed_step(client, hostile, traversal)
        assert seconds <= LIMITS.message_budget_s + SLACK_S
        assert "the call was stopped" in result["message"]["content"]  # by its time or memory budget
        assert result["info"]["error_type"] == "budget_exceeded" and result["info"]["num_over_budget"] == 1
    thread.join(120)
    assert not thread.is_alive() and latencies[-1] is True  # the innocent episode passed
    assert max(latencies[:-1]) <= LIMITS.message_budget_s + SLACK_S

    started = time.monotonic()
    evaluation = client.evaluate(hostile, release=True)
    assert time.monotonic() - started <= LIMITS.evaluate_budget_s + SLACK_S
    assert evaluation["valid"] is False and evaluation["tags"][0] == "budget_exceeded"


@pytest.mark.parametrize(
    "name,arguments",
    [
        ("round_number", {"number": 5, "decimal_places": -(10**9)}),
        ("logarithm", {"value": 10, "base": 2, "precision": "100000000"}),
        ("logarithm", {"value": 10, "base": 2, "precision": 10**9}),
        ("square_root", {"number": 2, "precision": 10**9}),
        ("power", {"base": 10**4000, "exponent": 10000}),
        ("power", {"base": 10, "exponent": 10**9}),
    ],
)
def test_math_blowups_are_refused_at_once(client, name, arguments):
    math_task = next(
        t
        for t in tasks.task_ids("all")
        if "MathAPI" in tasks.load_task(t).involved_classes
        and name in {d["name"] for d in tasks.load_task(t).functions}
    )
    iid = client.create(math_task, "validate")["instance_id"]
    result, seconds = timed_step(client, iid, call(name, **arguments))
    assert "this environment's limit" in result["message"]["content"]
    assert seconds < 1.0 + SLACK_S / 4
    client.release(iid)


def test_cat_flood_is_truncated(client):
    iid = client.create(FS_TASK, "validate")["instance_id"]
    client.step(iid, call("touch", file_name="big.txt") + call("echo", content="x" * 100_000, file_name="big.txt"))
    result, _ = timed_step(client, iid, "".join(call("cat", file_name="big.txt") for _ in range(39)))
    content = result["message"]["content"]
    assert len(content.encode()) <= LIMITS.max_reply_bytes + 200
    assert "[TRUNCATED:" in content
    client.release(iid)


def _survivor_passes(client, instance_id: str) -> None:
    task = tasks.load_task("multi_turn_base_2")
    for message in replay.ground_truth_messages(task):
        client.step(instance_id, message)
    assert client.evaluate(instance_id, release=True)["valid"] is True


def test_killed_worker_is_replaced_and_its_episodes_go_on(service, client):
    victim, survivor = episodes_on_two_workers(client, service, "multi_turn_base_2", "multi_turn_base_2")
    worker = worker_of(service, victim)
    restarts = worker.restarts
    os.kill(worker.process.pid, signal.SIGKILL)  # between requests: no episode's doing
    _survivor_passes(client, victim)  # rebuilt on the replacement before its next step
    assert worker.restarts == restarts + 1
    _survivor_passes(client, survivor)
    fresh = client.create("multi_turn_base_2", "validate")["instance_id"]  # the replacement serves
    _survivor_passes(client, fresh)
    assert requests.get(service.url + "/health", timeout=10).json()["workers"]["ok"] is True


def test_hung_worker_is_killed_after_its_deadline(service, client):
    victim, survivor = episodes_on_two_workers(client, service, "multi_turn_base_2", "multi_turn_base_2")
    worker = worker_of(service, victim)
    os.kill(worker.process.pid, signal.SIGSTOP)  # stops answering, like work no timer can interrupt
    outcome: dict = {}

    def step_victim():
        started = time.monotonic()
        try:
            client.step(victim, call("ls"))
        except EnvServiceError as error:
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=step_victim)
    thread.start()
    deadline = LIMITS.message_budget_s + LIMITS.worker_grace_s
    thread.join(60)
    assert outcome["error"].error == "episode_lost"
    assert outcome["seconds"] <= deadline + SLACK_S
    _survivor_passes(client, survivor)
    health = requests.get(service.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["workers"]["workers_answering"] == 2


def test_message_budget_skips_the_rest_and_the_replay_never_reruns_stopped_calls(monkeypatch):
    """In process (the test's main thread, where the timer works): a stopped call's recorded text stands in
    at evaluate, so evaluating costs nothing like the message did."""
    from env_service.bfcl.episode import Episode
    from env_service.bfcl.executor import BackendSession

    limits = ServiceLimits(call_budget_s=0.3, message_budget_s=0.5, evaluate_budget_s=5.0, call_memory_mib=4096)
    episode = Episode(tasks.load_task(FS_TASK), "validate", limits=limits)
    for message in aliasing_messages():
        episode.step(message)
    started = time.monotonic()
    result = episode.step(call("find", path=".") + call("du") + call("pwd"))
    assert time.monotonic() - started < limits.message_budget_s + SLACK_S
    blocks = result.message["content"].split("</tool_response>")
    assert "the call was stopped after 0.3 s, its time budget" in blocks[0]  # find: stopped
    assert "this message used up its time budget of 0.5 s" in blocks[2]  # pwd: the message's time was gone
    assert result.info["num_over_budget"] == 3
    executed = []
    original = BackendSession.execute

    def recording(session, tool_call, *limits_args):
        executed.append(tool_call.name)
        return original(session, tool_call, *limits_args)

    monkeypatch.setattr(BackendSession, "execute", recording)
    evaluation = episode.evaluate()
    assert "mv" in executed and not {"find", "du", "pwd"} & set(executed)  # stopped calls are not run again
    assert evaluation["tags"][0] == "budget_exceeded" and evaluation["valid"] is False
