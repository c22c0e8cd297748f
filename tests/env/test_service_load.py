"""Many concurrent episodes over HTTP: nothing lost, and every answer identical to a sequential run.

72 episodes are live at the same time (64 ground-truth replays of distinct tasks plus 8 deliberately
wrong trajectories), driven by 72 threads that start stepping together. Every create/step/evaluate
response must equal what a sequential in-process run of the same trajectories produces, and the
service's counters must account for every request.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from env_service import replay
from env_service.bfcl import tasks
from env_service.client import EnvClient, InProcessEnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread

N_GT = 64

UNAVAILABLE_CALL = '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'
MALFORMED_CALL = '<tool_call>\n{"name": "ls", "arguments": {oops}\n</tool_call>'


def _wrong_variants(task_id: str, k: int) -> list[str]:
    """Deliberately wrong trajectories of four kinds (rotating by ``k``); each leaves at least one
    GT-non-empty turn without an accepted call, so the verdict is certainly ``invalid``."""
    messages = replay.ground_truth_messages(tasks.load_task(task_id))
    calls = [m != replay.ADVANCE_TEXT for m in messages]
    kind = k % 4
    if kind == 0:  # answer every turn with text only
        return [m for m, is_call in zip(messages, calls) if not is_call]
    if kind == 1:  # a non-existent tool instead of every GT call message (rejected, nothing runs)
        return [UNAVAILABLE_CALL if is_call else m for m, is_call in zip(messages, calls)]
    if kind == 2:  # unparseable tool calls instead of the GT (parse errors)
        return [MALFORMED_CALL if is_call else m for m, is_call in zip(messages, calls)]
    last_call = max(i for i, is_call in enumerate(calls) if is_call)  # drop the last turn's calls
    return messages[:last_call] + messages[last_call + 1 :]


def _plan() -> list[tuple[str, list[str], bool]]:
    """(task id, assistant messages, expected to be valid) for 64 GT + 8 wrong episodes."""
    ids = tasks.task_ids("heldout")
    by_cat = {
        c: [t for t in ids if t.startswith(f"multi_turn_{c}_") and t not in replay.EXPECTED_FAILURES]
        for c in tasks.CATEGORIES
    }
    gt_ids = [by_cat[c][i] for i in range(N_GT // 4) for c in tasks.CATEGORIES]
    wrong_ids = [by_cat[c][N_GT // 4 + i] for i in range(2) for c in tasks.CATEGORIES]
    plan = [(t, replay.ground_truth_messages(tasks.load_task(t)), True) for t in gt_ids]
    plan += [(t, _wrong_variants(t, k), False) for k, t in enumerate(wrong_ids)]
    assert len({t for t, _, _ in plan}) == len(plan) == N_GT + 8
    return plan


def _strip_ids(created: dict) -> dict:
    info = {k: v for k, v in created["info"].items() if k != "instance_id"}
    return {"messages": created["messages"], "info": info}


def _run_episode(
    client,
    task_id: str,
    messages: list[str],
    request_id: str | None = None,
    created: dict | None = None,
    start: threading.Barrier | None = None,
) -> dict:
    created = created or client.create(task_id, "validate", {}, request_id=request_id)
    if start is not None:
        start.wait(timeout=120)
    steps = []
    for text in messages:
        step = client.step(created["instance_id"], text)
        steps.append(step)
        if step["terminated"]:
            break
    return {"created": created, "steps": steps, "evaluation": client.evaluate(created["instance_id"])}


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager()) as srv:
        yield srv


def test_72_concurrent_episodes_match_sequential_in_process(server):
    plan = _plan()
    n = len(plan)
    client = EnvClient(server.url, pool_size=n, retries=0)
    stats0 = client.health()

    # Phase 1: create all concurrently; every episode is live at once.
    with ThreadPoolExecutor(max_workers=n) as pool:
        created = list(pool.map(lambda p: client.create(p[0], "validate", {}), plan))
    assert len({c["instance_id"] for c in created}) == n
    assert client.health()["live"] == stats0["live"] + n

    # Phase 2: all threads start stepping at the same moment, then evaluate.
    start = threading.Barrier(n)
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(_run_episode, client, t, msgs, None, c, start) for (t, msgs, _), c in zip(plan, created)]
        concurrent = [f.result(timeout=300) for f in futures]
    assert client.health()["live"] == stats0["live"] + n  # nothing released or reclaimed behind our back

    # Phase 3: release all concurrently; each exactly once.
    with ThreadPoolExecutor(max_workers=16) as pool:
        released = list(pool.map(lambda c: client.release(c["instance_id"]), created))
    assert released == [True] * n

    stats = client.health()
    total_steps = sum(len(r["steps"]) for r in concurrent)
    assert stats["live"] == stats0["live"]
    assert stats["created"] - stats0["created"] == n
    assert stats["released"] - stats0["released"] == n
    assert stats["reclaimed"] == stats0["reclaimed"]
    assert stats["steps"] - stats0["steps"] == total_steps
    assert stats["evaluations"] - stats0["evaluations"] == n
    assert stats["episode_failures"] == 0

    # Verdicts as planned, and identical to a sequential in-process run of the same trajectories.
    inproc = InProcessEnvClient()
    for (task_id, messages, expect_valid), got in zip(plan, concurrent):
        assert got["evaluation"]["valid"] is expect_valid, (task_id, got["evaluation"]["error_type"])
        want = _run_episode(inproc, task_id, messages)
        assert _strip_ids(got["created"]) == _strip_ids(want["created"]), task_id
        assert got["steps"] == want["steps"], task_id
        assert got["evaluation"] == want["evaluation"], task_id
        inproc.release(want["created"]["instance_id"])
    assert inproc.health()["live"] == 0


def test_release_racing_steps_gives_only_clean_answers(server):
    """Steps, evaluations and a release of the same episode from different threads at once."""
    import random

    from env_service.client import EnvServiceError

    client = EnvClient(server.url, retries=0)
    failures_before = client.health()["episode_failures"]
    rng = random.Random(3)
    statuses: list[int] = []

    def hammer(instance_id: str, messages: list[str], start: threading.Barrier) -> None:
        start.wait(timeout=60)
        for text in messages:
            try:
                client.step(instance_id, text)
                client.evaluate(instance_id)
            except EnvServiceError as error:
                statuses.append(error.status)

    def release_soon(instance_id: str, start: threading.Barrier) -> None:
        start.wait(timeout=60)
        threading.Event().wait(rng.random() * 0.02)
        client.release(instance_id)

    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = []
        for task_id in tasks.task_ids("val")[:16]:
            instance_id = client.create(task_id, "validate")["instance_id"]
            start = threading.Barrier(2)
            messages = replay.ground_truth_messages(tasks.load_task(task_id))
            futures += [
                pool.submit(hammer, instance_id, messages, start),
                pool.submit(release_soon, instance_id, start),
            ]
        for future in futures:
            future.result(timeout=120)
    # Unknown instance (released) or conflict (stepped after termination) only; never a 500.
    assert set(statuses) <= {404, 409}, statuses
    health = client.health()
    assert health["episode_failures"] == failures_before and server.alive()
