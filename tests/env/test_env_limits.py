"""Per-episode and per-client limits against a real HTTP service (loopback, episodes in the service process).

Steps per episode, calls per message and retained backend state each answer the model with a text saying
which limit it hit; live episodes are capped per client (its address, whatever run ids it names) and in total; idle episodes are reclaimed,
and requests the service refused never count as activity.
"""

from __future__ import annotations

import json

import pytest
import requests

from env_service.bfcl.config import ServiceLimits
from env_service.client import EnvClient, EnvServiceError
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread

LIMITS = ServiceLimits(
    max_steps=6, max_calls_per_message=5, max_state_bytes=200_000, max_episodes=6, max_episodes_per_owner=3
)
FS_TASK = "multi_turn_base_0"
BAD_CALL = "<tool_call>{not json}</tool_call>"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def service():
    with ServerThread(EpisodeManager(limits=LIMITS)) as server:
        yield server


@pytest.fixture()
def client(service):
    with EnvClient(service.url, retries=0, timeout_s=30, run_id="limits-a") as c:
        yield c


def test_step_limit_ends_the_episode_with_a_text(client):
    iid = client.create(FS_TASK, "validate")["instance_id"]
    for _ in range(LIMITS.max_steps):  # parse errors: the turn never advances
        assert client.step(iid, BAD_CALL)["terminated"] is False
    last = client.step(iid, call("ls"))
    assert last["terminated"] is True and last["info"]["error_type"] == "limit_exceeded"
    assert f"limit of {LIMITS.max_steps} messages" in last["message"]["content"]
    with pytest.raises(EnvServiceError) as refused:
        client.step(iid, call("ls"))
    assert refused.value.status == 409
    client.release(iid)


def test_too_many_calls_in_one_message_run_none(client):
    iid = client.create(FS_TASK, "validate")["instance_id"]
    over = client.step(iid, "".join(call("mkdir", dir_name=f"d{i}") for i in range(LIMITS.max_calls_per_message + 1)))
    assert over["info"]["error_type"] == "limit_exceeded" and over["info"]["num_calls"] == 0
    assert f"the limit is {LIMITS.max_calls_per_message}" in over["message"]["content"]
    listing = client.step(iid, call("ls"))["message"]["content"]
    assert "d0" not in listing  # nothing of the refused message ran
    client.release(iid)


def test_state_limit_refuses_further_tool_calls(client):
    iid = client.create(FS_TASK, "validate")["instance_id"]
    grow = "".join(
        call("touch", file_name=f"f{i}.txt") + call("echo", content="y" * 60_000, file_name=f"f{i}.txt")
        for i in range(2)
    )
    assert "exceeds its limit" not in client.step(iid, grow)["message"]["content"]  # ~120 KB: within
    over = client.step(iid, grow.replace("f0", "f2").replace("f1", "f3"))  # ~240 KB: past the limit
    assert f"state exceeds its limit of {LIMITS.max_state_bytes} bytes" in over["message"]["content"]
    assert over["info"]["error_type"] == "budget_exceeded"
    after = client.step(iid, call("ls"))
    assert "tool calls are refused" in after["message"]["content"] and after["info"]["num_over_budget"] == 1
    evaluation = client.evaluate(iid, release=True)
    assert evaluation["tags"][0] == "budget_exceeded" and evaluation["valid"] is False


def test_live_episodes_are_capped_per_client_and_in_total(service, other_client_address):
    clients = [
        EnvClient(service.url, retries=0, timeout_s=30, run_id=f"limits-owner-{k}", source_address=source)
        for k, source in enumerate([None, other_client_address, None])  # all of loopback is one client
    ]
    try:
        first = [clients[0].create(FS_TASK, "validate")["instance_id"] for _ in range(LIMITS.max_episodes_per_owner)]
        with pytest.raises(EnvServiceError) as per_client:
            clients[0].create(FS_TASK, "validate")
        assert per_client.value.status == 503 and "this client" in per_client.value.message
        second = [clients[1].create(FS_TASK, "validate")["instance_id"] for _ in range(LIMITS.max_episodes_per_owner)]
        with pytest.raises(EnvServiceError) as total:  # 6 live: the service is full for everyone
            clients[2].create(FS_TASK, "validate")
        assert total.value.status == 503 and f"limit {LIMITS.max_episodes}" in total.value.message
        clients[0].release(first[0])
        clients[2].create(FS_TASK, "validate")  # a freed slot serves another client
    finally:
        for c in clients:
            c.close()
        for iid in first + second:
            service.manager.release(iid)
        service.manager.close_all()


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_reclaim_is_not_postponed_by_refused_requests():
    clock = FakeClock()
    manager = EpisodeManager(idle_timeout_s=600, clock=clock)
    with ServerThread(manager) as server, EnvClient(server.url, retries=0, timeout_s=30) as client:
        iid = client.create(FS_TASK, "validate")["instance_id"]
        clock.now += 500
        for body in (
            {"instance_id": iid, "content": "hi", "seq": 7},  # 409: wrong seq
            {"instance_id": iid, "content": "\ud800"},
        ):  # 422: not valid Unicode
            response = requests.post(
                server.url + "/step", data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=30
            )
            assert response.status_code in (409, 422), response.text
        clock.now += 200  # 700 s after the last accepted request
        assert manager.reclaim_idle() == 1
        with pytest.raises(EnvServiceError) as gone:
            client.step(iid, call("ls"))
        assert gone.value.status == 404

        kept = client.create(FS_TASK, "validate")["instance_id"]
        clock.now += 500
        client.step(kept, call("ls"))  # accepted: it counts as activity
        clock.now += 200
        assert manager.reclaim_idle() == 0


def test_service_defaults_reclaim_within_minutes_and_check_often():
    limits = ServiceLimits()
    assert limits.idle_timeout_s <= 15 * 60 and limits.reclaim_interval_s <= 30
