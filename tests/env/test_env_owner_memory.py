"""What all the live episodes of one client keep together has a budget (``max_owner_bytes``).

Against a real service (loopback HTTP) with two worker processes and small budgets: an attacker that fills its
episodes with big accepted calls (files written with 200 KB of text each) is refused (429 ``owner_memory_exceeded``)
once its episodes keep more than its budget, before any of its requests reach a worker; another client (from a local
address beyond loopback: all of loopback is one client) on the same workers creates, steps and passes a ground-truth
replay meanwhile; releasing episodes frees the budget; the count
follows release, reclaim and a lost episode; and the memory of the service and its workers grows by a small multiple
of the budget, not with the attack. Before, an owner's 1024 live episodes could keep tens of GiB.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from env_service import replay
from env_service.bfcl import tasks
from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient, EnvServiceError
from env_service.episodes.manager import EpisodeManager
from env_service.errors import OwnerMemoryExceeded
from env_service.http.service import ServerThread
from tests.support.env_attacks import big_file
from tests.support.env_attacks import tool_call as call

MIB = 1024 * 1024
LIMITS = ServiceLimits(
    max_owner_bytes=8 * MIB,
    max_episode_bytes=1 * MIB,
    max_state_bytes=1 * MIB,
    max_reply_bytes=4096,
    call_budget_s=2.0,
    message_budget_s=4.0,
)
FS_TASK = "multi_turn_base_0"  # GorillaFileSystem: touch and echo write files
INNOCENT_TASK = "multi_turn_base_2"
STEPS_PER_EPISODE = 4  # files per episode: within its own max_episode_bytes and max_state_bytes
ATTACK_EPISODES = 80  # ~64 MB of file text: 8 times the budget
RSS_GROWTH_LIMIT = 4 * LIMITS.max_owner_bytes


@pytest.fixture(scope="module")
def service():
    with ServerThread(EpisodeManager(workers=2, limits=LIMITS)) as server:
        yield server


LOOPBACK_CLIENT = "addr:loopback"


def _kept(service) -> int:
    """What the live episodes of the loopback client keep, as the service counts it."""
    return service.manager._client_bytes.get(LOOPBACK_CLIENT, 0)


def _answer_or_refusal(request, *args) -> tuple[dict | None, EnvServiceError | None]:
    """``request(*args)``'s answer, or the owner-memory refusal it got (any other error fails the test)."""
    try:
        return request(*args), None
    except EnvServiceError as error:
        assert (error.status, error.error) == (429, "owner_memory_exceeded"), error
        return None, error


def _fill(client: EnvClient, episodes: int = ATTACK_EPISODES) -> tuple[dict[str, int], EnvServiceError | None]:
    """Create episodes and write big files into them until the owner is refused; returns each live episode's last
    reported ``kept_bytes`` and the refusal (None when every request went through)."""
    kept: dict[str, int] = {}
    for _ in range(episodes):
        created, refusal = _answer_or_refusal(client.create, FS_TASK, "validate")
        if refusal:
            return kept, refusal
        instance_id = created["instance_id"]
        kept[instance_id] = created["info"]["kept_bytes"]
        for k in range(STEPS_PER_EPISODE):
            reply, refusal = _answer_or_refusal(client.step, instance_id, big_file(k))
            if refusal:
                return kept, refusal
            assert reply["info"]["num_tool_errors"] == 0 and not reply["terminated"], reply["message"]
            kept[instance_id] = reply["info"]["kept_bytes"]
    return kept, None


def _rss_bytes(service) -> int:
    """Resident memory of the service process (this one: the service runs in a thread) and its workers."""
    pids = [os.getpid(), *(worker.process.pid for worker in service.manager._pool._workers)]
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def _passes_ground_truth(client: EnvClient) -> bool:
    instance_id = client.create(INNOCENT_TASK, "validate")["instance_id"]
    for message in replay.ground_truth_messages(tasks.load_task(INNOCENT_TASK)):
        client.step(instance_id, message)
    return client.evaluate(instance_id, release=True)["valid"]


def test_a_client_over_its_budget_is_refused_and_its_memory_stays_bounded_while_others_go_on(
    service, other_client_address
):
    with (
        EnvClient(service.url, retries=0, timeout_s=60, run_id="attacker") as attacker,
        EnvClient(
            service.url, retries=0, timeout_s=60, run_id="innocent", source_address=other_client_address
        ) as innocent,
    ):
        assert _passes_ground_truth(innocent) is True  # warms the workers up before the memory is measured
        before = _rss_bytes(service)
        kept, refusal = _fill(attacker)
        grown = _rss_bytes(service) - before
        # before: all 80 episodes were filled (~64 MB of files, kept three times) and the processes grew with them
        assert grown < RSS_GROWTH_LIMIT, f"the service and its workers grew by {grown / MIB:.1f} MiB"
        assert refusal is not None, f"never refused; {len(kept)} episodes keep {sum(kept.values())} bytes"
        total = sum(kept.values())
        assert total > LIMITS.max_owner_bytes and _kept(service) == total
        detail = refusal.message
        assert f"keep {total} bytes" in detail and f"limit of {LIMITS.max_owner_bytes}" in detail
        assert "release" in detail
        some = next(iter(kept))
        assert _answer_or_refusal(attacker.step, some, call("ls"))[1] is not None  # a step of any of its episodes
        assert _answer_or_refusal(attacker.create, FS_TASK, "validate")[1] is not None
        assert _passes_ground_truth(innocent) is True  # another client on the same workers: unaffected

        assert attacker.evaluate(some)["valid"] is False  # evaluate and release always work: they free memory
        for instance_id in list(kept):
            if _kept(service) <= LIMITS.max_owner_bytes:
                break
            assert attacker.release(instance_id) is True
            del kept[instance_id]
            assert _kept(service) == sum(kept.values())
        fresh = attacker.create(FS_TASK, "validate")["instance_id"]  # room again
        assert attacker.step(fresh, call("ls"))["info"]["error_type"] is None
        for instance_id in [*kept, fresh]:
            attacker.release(instance_id)
        assert _kept(service) == 0


def test_the_count_follows_release_reclaim_and_a_killed_worker(service):
    manager = service.manager
    with EnvClient(service.url, retries=0, timeout_s=60, run_id="counted") as client:
        kept, refusal = _fill(client, episodes=3)
        assert refusal is None and _kept(service) == sum(kept.values())
        first, second, third = kept
        assert client.release(first) is True
        assert _kept(service) == kept[second] + kept[third]

        worker = next(w for w in manager._pool._workers if second in w.episodes)
        os.kill(worker.process.pid, signal.SIGKILL)
        assert client.evaluate(second, release=True)  # rebuilt on the replacement: it keeps what it kept, then frees it
        assert _kept(service) == kept[third]

        assert manager.reclaim_idle(now=manager._clock() + LIMITS.idle_timeout_s + 1) >= 1
        assert _kept(service) == 0 and LOOPBACK_CLIENT not in manager._client_bytes
        with pytest.raises(EnvServiceError) as gone:
            client.step(third, call("ls"))
        assert gone.value.error == "unknown_instance"


def test_in_process_episodes_are_counted_from_their_replies():
    manager = EpisodeManager(limits=LIMITS.replace(max_owner_bytes=1 * MIB))
    created = manager.create(FS_TASK, "validate", owner="run:big")
    instance_id, kept = created["instance_id"], created["info"]["kept_bytes"]
    assert 0 < kept < 200_000 and manager._client_bytes["run:big"] == kept  # its task, prompt, state, first answer
    steps = 0
    while manager._client_bytes["run:big"] <= 1 * MIB:
        info = manager.step(instance_id, big_file(steps), owner="run:big")["info"]
        steps += 1
        assert manager._client_bytes["run:big"] == info["kept_bytes"] > kept
        kept = info["kept_bytes"]
    assert steps < STEPS_PER_EPISODE  # records and state of each file count (~400 KB a message)
    with pytest.raises(OwnerMemoryExceeded):
        manager.step(instance_id, call("ls"), owner="run:big")
    with pytest.raises(OwnerMemoryExceeded):
        manager.create(FS_TASK, "validate", owner="run:big")
    other = manager.create(FS_TASK, "validate", owner="run:other")["instance_id"]
    assert manager.step(other, call("ls"), owner="run:other")["info"]["error_type"] is None
    manager.evaluate(instance_id, release=True, owner="run:big")
    assert "run:big" not in manager._client_bytes
    manager.create(FS_TASK, "validate", owner="run:big")
    manager.close_all()
    assert manager._client_bytes == {}


def test_a_ground_truth_episode_keeps_little():
    """An innocent trainer never comes near the default budget: a ground-truth episode keeps its task and prompt, its
    calls' arguments and results, its state and what the service holds for it (measured: 184 KB for the largest, in
    this process), not ``max_reply_bytes`` for each message's results (before: 128 KiB per message with calls), so
    even an owner's 1024 largest episodes keep a fifth of the default budget."""
    largest = 200 * 1024
    manager = EpisodeManager()
    task = tasks.load_task("multi_turn_long_context_113")  # the largest ground-truth episode
    instance_id = manager.create(task.id, "validate")["instance_id"]
    for message in replay.ground_truth_messages(task):
        info = manager.step(instance_id, message)["info"]
    assert info["kept_bytes"] < largest
    assert manager.evaluate(instance_id, release=True)["valid"] is True
    defaults = ServiceLimits()
    assert defaults.max_episodes_per_owner * largest <= defaults.max_owner_bytes / 5
