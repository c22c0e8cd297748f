"""The HTTP service against a real uvicorn server on an ephemeral 127.0.0.1 port.

Covers the happy path of every endpoint, that bad input of every kind gets a 4xx with an actionable
message (never a 500, never a traceback), retries that are safe by construction (create with an id,
step ``seq``), and that the server is still healthy afterwards.
"""

from __future__ import annotations

import json

import pytest
import requests

from env_service import replay
from env_service.bfcl import tasks
from env_service.bfcl.config import EnvConfig
from env_service.bfcl.episode import Episode
from env_service.client import EnvClient, EnvServiceError, InProcessEnvClient
from env_service.episodes.manager import MAX_CONTENT_BYTES, EpisodeManager
from env_service.http.limits import MAX_BODY_BYTES
from env_service.http.service import ServerThread

TASK = "multi_turn_base_0"
CUE_PROFILE = {"tags": {"missing_tool_call": {"count": 40, "reward_mean": 0.1}}}
CUE_PARAMS = {"capability_cues": {"enable": True}}


@pytest.fixture(scope="module")
def server():
    with ServerThread(EpisodeManager(max_episodes=512)) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with EnvClient(server.url, retries=0) as c:
        yield c


def post_raw(server, path: str, body: bytes, content_type: str = "application/json") -> requests.Response:
    return requests.post(f"{server.url}{path}", data=body, headers={"Content-Type": content_type}, timeout=30)


def assert_clean_error(response: requests.Response, status: int, *needles: str) -> dict:
    """A JSON ``{"error", "detail"}`` body with the expected status and actionable text, no traceback."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error", "detail"}, body
    assert "Traceback" not in response.text and 'File "' not in response.text
    for needle in needles:
        assert needle.lower() in body["detail"].lower(), (needle, body)
    return body


# ---------------------------------------------------------------------------------------------
# Happy paths
# ---------------------------------------------------------------------------------------------


def test_health_and_alias(server, client):
    health = client.health()
    assert health["status"] == "ok"
    for key in ("live", "created", "released", "reclaimed", "steps", "evaluations"):
        assert isinstance(health[key], int)
    assert requests.get(f"{server.url}/healthz", timeout=10).json()["status"] == "ok"


def test_gt_episode_roundtrip_matches_episode(client):
    task = tasks.load_task(TASK)
    created = client.create(TASK, "validate", {})
    # The exact initial messages an Episode builds for the same task/config.
    assert created["messages"] == Episode(task, "validate", EnvConfig()).initial_messages()
    assert created["info"]["task_id"] == TASK and created["info"]["mode"] == "validate"
    instance_id = created["instance_id"]
    steps = [client.step(instance_id, text) for text in replay.ground_truth_messages(task)]
    assert steps[-1]["terminated"] and not any(s["terminated"] for s in steps[:-1])
    assert steps[-1]["message"]["content"] == "[CONVERSATION_COMPLETED]"
    evaluation = client.evaluate(instance_id)
    assert evaluation["valid"] is True and evaluation["reward"] == 1.0
    assert evaluation == replay.replay_ground_truth(task).to_dict() | {
        "num_turns": evaluation["num_turns"],
        "num_steps": len(steps),
    }
    # evaluate with a per-call reward config, then release exactly once
    capped = client.evaluate(instance_id, {"mode": "capped", "partial_credit_cap": 0.5})
    assert capped["valid"] is True
    assert client.release(instance_id) is True
    assert client.release(instance_id) is False


def test_evaluate_can_release_the_episode_in_the_same_round_trip(client):
    instance_id = client.create(TASK, "validate", {})["instance_id"]
    live = client.health()["live"]
    evaluation = client.evaluate(instance_id, release=True)
    assert evaluation["valid"] is False and evaluation["error_type"] == "multi_turn:force_terminated"
    assert client.health()["live"] == live - 1
    with pytest.raises(EnvServiceError) as err:
        client.step(instance_id, "hello")
    assert err.value.status == 404
    assert client.release(instance_id) is False


def test_a_touch_keeps_an_episode_from_the_idle_reclaim_and_only_its_owner_may_touch_it(server):
    """``POST /touch`` marks an episode in use (its client waits for a generation); the reclaim then spares it, and a
    touch by another run, or of an episode already gone, is a 404 like any unknown id."""
    clock = [0.0]
    manager = EpisodeManager(idle_timeout_s=10.0, clock=lambda: clock[0])
    with ServerThread(manager) as srv, EnvClient(srv.url, retries=0, run_id="a") as owner:
        with EnvClient(srv.url, retries=0, run_id="b") as other:
            created = owner.create(TASK, "validate", {})
            instance_id = created["instance_id"]
            assert created["info"]["idle_timeout_s"] == 10.0  # what a client must touch within
            clock[0] = 8.0
            assert owner.touch(instance_id) is True
            with pytest.raises(EnvServiceError) as err:
                other.touch(instance_id)
            assert err.value.status == 404
            clock[0] = 15.0  # 15 s after its create, 7 s after its touch
            assert manager.reclaim_idle() == 0
            clock[0] = 19.0
            assert manager.reclaim_idle() == 1
            with pytest.raises(EnvServiceError) as err:
                owner.touch(instance_id)
            assert err.value.status == 404


def test_http_and_in_process_give_identical_answers(client):
    inproc = InProcessEnvClient()
    for mode in ("train", "validate"):
        a = client.create("multi_turn_miss_func_3", mode, {"observation_lite": {"enable": True}})
        b = inproc.create("multi_turn_miss_func_3", mode, {"observation_lite": {"enable": True}})
        assert a["messages"] == b["messages"]
        for text in ["hi", '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>', "<tool_call>{oops"]:
            sa, sb = client.step(a["instance_id"], text), inproc.step(b["instance_id"], text)
            assert sa == sb
        assert client.evaluate(a["instance_id"]) == inproc.evaluate(b["instance_id"])
        client.release(a["instance_id"])
        inproc.release(b["instance_id"])


def test_profile_reaches_new_train_episodes_only(client):
    version = client.set_profile(CUE_PROFILE)["version"]
    got = client.get_profile()
    assert got["profile"] == CUE_PROFILE and got["version"] == version
    train = client.create(TASK, "train", CUE_PARAMS)
    val = client.create(TASK, "validate", CUE_PARAMS)
    try:
        assert train["info"]["profile_version"] == version
        assert "# Behavioral guidelines" in train["messages"][0]["content"]
        assert val["info"]["profile_version"] is None
        assert "# Behavioral guidelines" not in val["messages"][0]["content"]
    finally:
        client.release(train["instance_id"])
        client.release(val["instance_id"])


def test_retried_step_with_same_seq_is_applied_once(server, client):
    instance_id = client.create(TASK, "validate")["instance_id"]
    body = {"instance_id": instance_id, "content": "first turn done", "seq": 0}
    first = requests.post(f"{server.url}/step", json=body, timeout=10)
    again = requests.post(f"{server.url}/step", json=body, timeout=10)  # a retry after a lost response
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    evaluation = client.evaluate(instance_id)
    assert evaluation["num_steps"] == 1
    stale = requests.post(f"{server.url}/step", json={**body, "seq": 5}, timeout=10)
    assert_clean_error(stale, 409, "expected seq 1")
    client.release(instance_id)


def test_retried_create_with_same_request_id_returns_the_same_episode(client):
    first = client.create(TASK, "validate", request_id="retry-me")
    again = client.create(TASK, "validate", request_id="retry-me")
    assert first == again
    with pytest.raises(EnvServiceError) as err:
        client.create("multi_turn_base_1", "validate", request_id="retry-me")
    assert err.value.status == 409 and "already started an episode" in err.value.message
    assert client.release(first["instance_id"])


# ---------------------------------------------------------------------------------------------
# Bad input: 4xx with a message that says what to fix
# ---------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (path, raw body, content type, status, needles in detail)
    (
        "/create",
        {"task_id": "multi_turn_base_999", "mode": "train"},
        None,
        404,
        ["unknown task_id", "multi_turn_<category>_<index>"],
    ),
    ("/create", {"task_id": "nope", "mode": "train"}, None, 404, ["unknown task_id"]),
    ("/create", {"task_id": TASK, "mode": "sample"}, None, 422, ["mode", "'train' or 'validate'"]),
    (
        "/create",
        {"task_id": TASK, "mode": "train", "params": {"observation_lite": {"enabel": True}}},
        None,
        422,
        ["enabel", "allowed keys"],
    ),
    (
        "/create",
        {"task_id": TASK, "mode": "train", "params": {"strict_tool_parser": "yes"}},
        None,
        422,
        ["strict_tool_parser", "boolean"],
    ),
    ("/create", {"task_id": TASK, "mode": "train", "params": [1, 2]}, None, 422, ["params"]),
    ("/create", {"task_id": 17, "mode": "train"}, None, 422, ["task_id", "string"]),
    ("/create", {"mode": "train"}, None, 422, ["task_id", "required"]),
    ("/create", {"task_id": TASK, "mode": "train", "env_type": "bfcl"}, None, 422, ["env_type", "extra"]),
    ("/create", {"task_id": TASK, "mode": "train", "request_id": "x" * 500}, None, 400, ["request_id"]),
    ("/step", {"instance_id": "never-created", "content": "hi"}, None, 404, ["unknown instance_id"]),
    ("/step", {"instance_id": "x", "content": 5}, None, 422, ["content", "string"]),
    ("/step", {"instance_id": "x", "content": None}, None, 422, ["content"]),
    ("/step", {"instance_id": "x", "content": "hi", "seq": -1}, None, 422, ["seq"]),
    ("/step", {"instance_id": "x", "content": "hi", "seq": "1"}, None, 422, ["seq"]),
    ("/step", b'{"instance_id": "x", "content": ', None, 422, ["malformed JSON"]),
    ("/step", b"", None, 422, ["body was empty"]),
    ("/step", b"not json at all", None, 422, ["malformed JSON"]),
    ("/step", b"[1, 2, 3]", None, 422, ["must be a JSON object"]),
    ("/step", b'{"instance_id": "x", "content": "\xff\xfe\x80"}', None, 400, ["UTF-8"]),
    (
        "/step",
        json.dumps({"instance_id": "x", "content": "hi"}).encode(),
        "text/plain",
        422,
        ["Content-Type: application/json"],
    ),
    ("/step", b"[" * 10_000 + b"]" * 10_000, None, 400, []),
    ("/evaluate", {"instance_id": "never-created"}, None, 404, ["unknown instance_id"]),
    ("/evaluate", {"instance_id": "x", "reward": "binary"}, None, 422, ["reward"]),
    ("/release", {"instance_id": ["x"]}, None, 422, ["instance_id"]),
    ("/profile", {"profile": [1, 2]}, None, 422, ["profile"]),
    ("/profile", b'{"profile": {"tags": NaN}}', None, 400, ["NaN"]),
]


@pytest.mark.parametrize(
    "path,body,content_type,status,needles",
    BAD_REQUESTS,
    ids=[f"{i}-{r[0]}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)],
)
def test_bad_requests_get_actionable_4xx(server, path, body, content_type, status, needles):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert_clean_error(post_raw(server, path, raw, content_type or "application/json"), status, *needles)


def test_invalid_reward_config_names_the_key(client, server):
    instance_id = client.create(TASK, "validate")["instance_id"]
    response = requests.post(
        f"{server.url}/evaluate", timeout=10, json={"instance_id": instance_id, "reward": {"mode": "dense"}}
    )
    assert_clean_error(response, 422, "reward.mode", "binary")
    response = requests.post(
        f"{server.url}/evaluate", timeout=10, json={"instance_id": instance_id, "reward": {"cap": 0.1}}
    )
    assert_clean_error(response, 422, "'cap'")
    client.release(instance_id)


def test_oversize_content_and_body(server, client):
    instance_id = client.create(TASK, "validate")["instance_id"]
    ok = requests.post(
        f"{server.url}/step", timeout=30, json={"instance_id": instance_id, "content": "a" * MAX_CONTENT_BYTES}
    )
    assert ok.status_code == 200, ok.text[:300]
    too_big = requests.post(
        f"{server.url}/step", timeout=30, json={"instance_id": instance_id, "content": "a" * (MAX_CONTENT_BYTES + 1)}
    )
    assert_clean_error(too_big, 413, "256 KiB", "truncate")
    # Multi-byte characters count as bytes, not characters.
    wide = requests.post(
        f"{server.url}/step",
        timeout=30,
        json={"instance_id": instance_id, "content": "é" * (MAX_CONTENT_BYTES // 2 + 1)},
    )
    assert_clean_error(wide, 413, "bytes")
    body = post_raw(server, "/step", b'{"instance_id": "x", "content": "' + b"a" * MAX_BODY_BYTES + b'"}')
    assert_clean_error(body, 413, "request body exceeds")
    client.release(instance_id)


def test_lone_surrogate_is_refused_with_its_position(server, client):
    instance_id = client.create(TASK, "validate")["instance_id"]
    response = post_raw(server, "/step", json.dumps({"instance_id": instance_id, "content": "ab\ud800c"}).encode())
    assert response.status_code == 422 and "Traceback" not in response.text
    with pytest.raises(EnvServiceError) as err:  # the client sends it escaped; same answer
        client.step(instance_id, "ab\ud800c")
    assert err.value.status == 422
    with pytest.raises(EnvServiceError) as err:  # and the in-process client agrees
        inproc = InProcessEnvClient()
        inproc.step(inproc.create(TASK, "validate")["instance_id"], "ab\ud800c")
    assert err.value.status == 422 and "index 2" in err.value.message
    client.release(instance_id)


def test_step_after_termination_is_409(client):
    instance_id = client.create("multi_turn_base_180", "validate")["instance_id"]
    for _ in range(20):
        if client.step(instance_id, "nothing to do")["terminated"]:
            break
    with pytest.raises(EnvServiceError) as err:
        client.step(instance_id, "one more")
    assert err.value.status == 409 and "terminated" in err.value.message
    assert client.evaluate(instance_id)["valid"] is False
    client.release(instance_id)


def test_wrong_methods_and_routes(server):
    assert_clean_error(requests.get(f"{server.url}/step", timeout=10), 405)
    assert_clean_error(requests.post(f"{server.url}/nope", json={}, timeout=10), 404)


# ---------------------------------------------------------------------------------------------
# Client behaviour: error mapping and bounded retries
# ---------------------------------------------------------------------------------------------


def test_client_raises_server_message_and_never_retries_4xx(server, monkeypatch):
    client = EnvClient(server.url, retries=3, backoff_s=0.0)
    calls = []
    adapter = client.session.get_adapter(client.url)
    original = adapter.send
    monkeypatch.setattr(adapter, "send", lambda *a, **k: calls.append(1) or original(*a, **k))
    with pytest.raises(EnvServiceError) as err:
        client.create("multi_turn_nope_1", "train")
    assert err.value.status == 404 and err.value.error == "unknown_task"
    assert "unknown task_id" in err.value.message
    assert len(calls) == 1


def test_client_retries_503_then_gives_up(monkeypatch):
    with ServerThread(EpisodeManager(max_episodes=1)) as small:
        client = EnvClient(small.url, retries=2, backoff_s=0.0)
        calls = []
        adapter = client.session.get_adapter(client.url)
        original = adapter.send
        monkeypatch.setattr(adapter, "send", lambda *a, **k: calls.append(1) or original(*a, **k))
        held = client.create(TASK, "validate")
        with pytest.raises(EnvServiceError) as err:
            client.create(TASK, "validate")
        assert err.value.status == 503 and "limit 1" in err.value.message
        assert len(calls) == 1 + 3  # the held create, then 1 try + 2 retries
        client.release(held["instance_id"])
        assert client.create(TASK, "validate")["instance_id"]


def test_client_unreachable_after_bounded_retries():
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = EnvClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.0, timeout_s=2)
    with pytest.raises(EnvServiceError) as err:
        client.health()
    assert err.value.status is None and "3 attempt" in err.value.message


def test_idle_episodes_are_reclaimed(server, client):
    instance_id = client.create(TASK, "validate")["instance_id"]
    manager = server.manager
    before = manager.stats()["reclaimed"]
    assert manager.reclaim_idle(now=manager._clock() + manager.idle_timeout_s + 1) >= 1
    assert manager.stats()["reclaimed"] > before
    with pytest.raises(EnvServiceError) as err:
        client.step(instance_id, "hi")
    assert err.value.status == 404 and "reclaimed" in err.value.message


def test_server_still_healthy_after_everything(server, client):
    assert server.alive()
    health = client.health()
    assert health["status"] == "ok" and health["episode_failures"] == 0
    assert health["client_errors"] > 0


def test_background_reclaim_loop_runs():
    import time

    manager = EpisodeManager(idle_timeout_s=0.2, reclaim_interval_s=0.1)
    with ServerThread(manager) as srv:
        client = EnvClient(srv.url, retries=0)
        client.create(TASK, "validate")
        deadline = time.monotonic() + 10
        while client.health()["reclaimed"] < 1:
            assert time.monotonic() < deadline, "idle episode was never reclaimed"
            time.sleep(0.1)
        assert client.health()["live"] == 0


def test_lost_responses_are_retried_without_double_effects(server, monkeypatch):
    """The server applies the request, the answer is lost, the client retries: same answer, applied once."""
    client = EnvClient(server.url, retries=2, backoff_s=0.0)
    adapter = client.session.get_adapter(client.url)
    original = adapter.send
    lose_next = {"on": False}

    def flaky_send(request, **kwargs):
        response = original(request, **kwargs)
        if lose_next["on"]:
            lose_next["on"] = False
            raise requests.ConnectionError("connection reset after the request was served")
        return response

    monkeypatch.setattr(adapter, "send", flaky_send)
    lose_next["on"] = True
    created = client.create(TASK, "validate")  # served, answer lost, retried with the same id
    assert server.manager.stats()["live"] >= 1
    lose_next["on"] = True
    first = client.step(created["instance_id"], "moving on")  # served, answer lost, retried: same seq
    assert first["message"]["content"] == tasks.load_task(TASK).question[1][0]["content"]
    second = client.step(created["instance_id"], "moving on")
    assert second["message"]["content"] == tasks.load_task(TASK).question[2][0]["content"]
    assert client.evaluate(created["instance_id"])["num_steps"] == 2
    assert client.release(created["instance_id"])


def test_a_retried_evaluate_and_release_gets_the_same_evaluation(server, monkeypatch):
    """evaluate(release=True) is served, its answer is lost, the client retries: the same evaluation, not 404."""
    client = EnvClient(server.url, retries=2, backoff_s=0.0)
    instance_id = client.create(TASK, "validate")["instance_id"]
    client.step(instance_id, "moving on")
    before_release = client.evaluate(instance_id)
    released = server.manager.stats()["released"]
    adapter = client.session.get_adapter(client.url)
    original = adapter.send
    lost = []

    def lose_first_answer(request, **kwargs):
        response = original(request, **kwargs)
        if not lost:
            lost.append(request.path_url)
            raise requests.ConnectionError("connection reset after the request was served")
        return response

    monkeypatch.setattr(adapter, "send", lose_first_answer)
    assert client.evaluate(instance_id, release=True) == before_release
    assert lost == ["/evaluate"] and server.manager.stats()["released"] == released + 1
    assert client.evaluate(instance_id, release=True) == before_release  # any later retry too
    with pytest.raises(EnvServiceError) as err:  # a different question about a released episode is still 404
        client.evaluate(instance_id, {"mode": "capped", "partial_credit_cap": 0.5})
    assert err.value.status == 404
    with pytest.raises(EnvServiceError):
        client.step(instance_id, "more")  # released is released: only the evaluation is kept


def test_kept_evaluations_expire():
    from env_service.episodes.manager import EVALUATION_CACHE_TTL_S

    now = [0.0]
    manager = EpisodeManager(clock=lambda: now[0])
    instance_id = manager.create(TASK, "validate")["instance_id"]
    first = manager.evaluate(instance_id, release=True)
    now[0] += EVALUATION_CACHE_TTL_S - 1
    assert manager.evaluate(instance_id, release=True) == first
    now[0] += 2
    with pytest.raises(Exception, match="unknown instance_id"):
        manager.evaluate(instance_id, release=True)
