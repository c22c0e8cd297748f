"""Limits that protect other clients count per client address, whatever run ids it names; a client's kept verdicts
are its own; a retried create that overlaps its original gets the original's episode.

Against a real service (loopback HTTP, one worker process, small limits). All of loopback is one client; a second
client connects to 127.0.0.1 from a local address beyond loopback (skipped on a machine without one).

* One client naming 4 run ids holds one client's live episodes, memory and requests in flight, not 4 (before: 4x
  each, so one client took the whole service); another client still gets its own share.
* Another client finishing many episodes evicts its own kept verdicts, never an innocent's (before: one pool, the
  innocent's retried ``evaluate(release)`` got 404); when all clients together keep too many, the biggest holder
  gives up its oldest.
* A create whose first attempt timed out behind another client's slow message: the retry with the same
  ``request_id`` waits for the original and gets its episode, over raw HTTP and through ``EnvClient`` (before: 409,
  and the original stayed live under an id the client never learnt).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient, EnvServiceError
from env_service.episodes.manager import EpisodeManager
from env_service.errors import UnknownInstance
from env_service.http.limits import HttpLimits
from env_service.http.service import ServerThread
from tests.support.env_attacks import aliasing_messages, big_file, call

MIB = 1024 * 1024
SLOW_S = 3.0  # a budget-busting message holds the one worker about this long (up to 2 s more on a busy machine)
LIMITS = ServiceLimits(
    max_episodes_per_owner=4,
    max_owner_bytes=1 * MIB,
    evaluations_kept_per_client=4,
    evaluations_kept=8,
    call_budget_s=SLOW_S,
    message_budget_s=SLOW_S,
    call_memory_mib=1024,  # room for the find to run into its time budget, not its memory budget (~1 GiB)
)
HTTP = HttpLimits(max_requests_per_owner=4)
RUN_IDS = [f"run-{k}" for k in range(4)]
TASK = "multi_turn_base_2"
FS_TASK = "multi_turn_base_0"
LOOPBACK_CLIENT = "addr:loopback"


@pytest.fixture(scope="module")
def service():
    with ServerThread(EpisodeManager(workers=1, limits=LIMITS), limits=HTTP) as server:
        yield server


@pytest.fixture()
def runs(service):
    """One loopback client naming 4 run ids (an EnvClient each); every episode is released afterwards."""
    clients = [EnvClient(service.url, retries=0, timeout_s=60, run_id=run_id) for run_id in RUN_IDS]
    yield clients
    for client in clients:
        client.close()
    for slot in list(service.manager._slots.values()):
        service.manager.release(slot.instance_id)


def _created(client: EnvClient, task: str = FS_TASK) -> str | None:
    """A new episode's id, or None when the client's episode cap refused it (any other error fails the test)."""
    try:
        return client.create(task, "validate")["instance_id"]
    except EnvServiceError as error:
        assert (error.status, error.error) == (503, "capacity_exceeded") and "this client" in error.message, error
        return None


def _live_of(service, client: str) -> list[str]:
    return [slot.instance_id for slot in list(service.manager._slots.values()) if slot.client == client]


def _busy_worker(service, address: str) -> threading.Thread:
    """Another client's message that runs to its budget on the one worker (started, and running, on return)."""
    hostile = EnvClient(service.url, retries=0, timeout_s=60, run_id="hostile", source_address=address)
    instance_id = hostile.create(FS_TASK, "validate")["instance_id"]
    for message in aliasing_messages():  # after these, a find runs to its budget
        hostile.step(instance_id, message)

    def slow() -> None:
        hostile.step(instance_id, call("find", path="."))
        hostile.evaluate(instance_id, release=True)
        hostile.close()

    thread = threading.Thread(target=slow)
    thread.start()
    deadline = time.monotonic() + 30
    while service.manager.health()["per_worker"][0]["busy_s"] < 0.2:  # the find runs (other requests take ms)
        assert time.monotonic() < deadline and thread.is_alive(), "the slow message never started"
        time.sleep(0.02)
    return thread


# -- per-client limits, whatever run ids -----------------------------------------------------------------


def test_run_ids_share_their_clients_episode_cap(service, runs, other_client_address):
    created = [_created(client) for client in runs for _ in range(LIMITS.max_episodes_per_owner)]
    live = [instance_id for instance_id in created if instance_id]
    assert len(live) == LIMITS.max_episodes_per_owner  # before: 4 per run id, 16
    assert sorted(_live_of(service, LOOPBACK_CLIENT)) == sorted(live)
    for client in runs[1:]:  # run ids still partition the client's episodes (the first run id holds them all)
        with pytest.raises(EnvServiceError) as unknown:
            client.step(live[0], "hi")
        assert unknown.value.status == 404
    with EnvClient(service.url, retries=0, timeout_s=60, run_id="other", source_address=other_client_address) as other:
        theirs = [_created(other) for _ in range(LIMITS.max_episodes_per_owner)]
        assert None not in theirs  # another address: a share of its own


def test_run_ids_share_their_clients_memory_budget(service, runs, other_client_address):
    kept, refusals = {}, []
    for client in runs:  # each run id fills an episode of its own until the client is refused
        try:
            instance_id = client.create(FS_TASK, "validate")["instance_id"]
            for k in range(4):  # ~400 KB kept per message: 4 reach 1 MiB
                kept[instance_id] = client.step(instance_id, big_file(k))["info"]["kept_bytes"]
        except EnvServiceError as error:
            assert (error.status, error.error) == (429, "owner_memory_exceeded"), error
            refusals.append(error.message)
    total = sum(kept.values())
    # before: each run id kept its own max_owner_bytes, ~4 MiB together
    assert total < 2 * LIMITS.max_owner_bytes, total
    assert service.manager._client_bytes[LOOPBACK_CLIENT] >= total
    assert len(refusals) == len(runs) and all("all its run ids" in message for message in refusals)
    with EnvClient(service.url, retries=0, timeout_s=60, run_id="other", source_address=other_client_address) as other:
        instance_id = other.create(FS_TASK, "validate")["instance_id"]
        assert other.step(instance_id, big_file(0))["info"]["num_tool_errors"] == 0  # its own budget
        other.release(instance_id)


def test_run_ids_share_their_clients_requests_in_flight(service, runs, other_client_address):
    busy = _busy_worker(service, other_client_address)

    def create(client: EnvClient) -> str:
        try:
            client.create(TASK, "validate")
            return "created"
        except EnvServiceError as error:
            return error.error

    with ThreadPoolExecutor(2 * len(runs)) as pool:  # 2 per run id, all waiting for the worker
        answers = list(pool.map(create, [client for client in runs for _ in range(2)]))
    busy.join()
    # before: 2 per run id were in flight, 8 of the client's; now its 4 are, the rest refused at once
    assert answers.count("created") == HTTP.max_requests_per_owner, answers
    assert answers.count("too_many_requests") == len(answers) - HTTP.max_requests_per_owner, answers


# -- kept verdicts per client ---------------------------------------------------------------------------


def _finished(client: EnvClient) -> tuple[str, dict]:
    instance_id = client.create(TASK, "validate")["instance_id"]
    client.step(instance_id, "Done.")
    return instance_id, client.evaluate(instance_id, release=True)


def test_another_client_finishing_many_episodes_keeps_the_innocents_verdict(service, other_client_address):
    with (
        EnvClient(service.url, retries=0, timeout_s=60, run_id="innocent") as innocent,
        EnvClient(service.url, retries=0, timeout_s=60, run_id="flood", source_address=other_client_address) as flood,
    ):
        instance_id, verdict = _finished(innocent)
        flooded = [_finished(flood)[0] for _ in range(3 * LIMITS.evaluations_kept)]
        # before: one pool of kept verdicts, the flood evicted the innocent's (404 on its retry)
        assert innocent.evaluate(instance_id, release=True) == verdict
        with pytest.raises(EnvServiceError) as evicted:  # the flood's oldest: evicted by its own
            flood.evaluate(flooded[0], release=True)
        assert evicted.value.status == 404
        assert flood.evaluate(flooded[-1], release=True)["task_id"] == TASK  # its latest are kept
        kept = service.manager._verdicts
        assert kept.count_of(f"addr:{other_client_address}") == LIMITS.evaluations_kept_per_client


# -- a create retried while its original runs -------------------------------------------------------------


def test_a_create_retried_while_its_original_waits_gets_the_same_episode(service, other_client_address):
    body = {"task_id": TASK, "mode": "validate", "request_id": "rq-overlap"}
    busy = _busy_worker(service, other_client_address)
    with pytest.raises(requests.ReadTimeout):  # the first attempt waits behind the other client's message
        requests.post(service.url + "/create", json=body, timeout=0.5)
    retry = requests.post(service.url + "/create", json=body, timeout=60)
    busy.join()
    assert retry.status_code == 200, retry.text  # before: 409, the request id being in use
    assert _live_of(service, LOOPBACK_CLIENT) == [retry.json()["instance_id"]]  # no second, no orphan
    requests.post(service.url + "/release", json={"instance_id": retry.json()["instance_id"]}, timeout=30)


def test_the_client_retrying_a_create_behind_a_slow_message_gets_one_episode(service, other_client_address, caplog):
    busy = _busy_worker(service, other_client_address)
    # The first attempt times out (the original waits SLOW_S - 0.5 s at least); the original's episode comes to the
    # retry that is waiting then: before, that retry's own create ran after the original's and was answered 409, the
    # request id being in use.
    with EnvClient(service.url, retries=4, backoff_s=0.05, timeout_s=SLOW_S - 1.5) as client:
        created = client.create(TASK, "validate")
    busy.join()
    assert "ReadTimeout on create" in caplog.text  # the first attempt did time out: its retry overlapped it
    assert _live_of(service, LOOPBACK_CLIENT) == [created["instance_id"]]
    requests.post(service.url + "/release", json={"instance_id": created["instance_id"]}, timeout=30)


def test_when_all_clients_together_keep_too_many_verdicts_the_biggest_holder_loses_its_oldest():
    manager = EpisodeManager(limits=ServiceLimits(evaluations_kept_per_client=4, evaluations_kept=6))

    def finish(client: str) -> tuple[str, dict]:
        instance_id = manager.create(TASK, "validate", owner=client)["instance_id"]
        return instance_id, manager.evaluate(instance_id, release=True, owner=client)

    innocent, verdict = finish("innocent")  # the oldest verdict of all
    flooded = {client: [finish(client)[0] for _ in range(4)] for client in ("flood-a", "flood-b")}
    # before: one pool, oldest first: the innocent's went first
    assert manager.evaluate(innocent, release=True, owner="innocent") == verdict
    kept = {client: manager._verdicts.count_of(client) for client in ("innocent", "flood-a", "flood-b")}
    assert kept == {"innocent": 1, "flood-a": 3, "flood-b": 2}  # the two floods gave up their oldest, in turn
    with pytest.raises(UnknownInstance):  # the first flood's oldest
        manager.evaluate(flooded["flood-a"][0], release=True, owner="flood-a")
