"""Round 3 of the real service's HTTP limits on 127.0.0.1: pipelined requests and request bodies in flight cost
bounded memory before anyone is authenticated (the service's own RSS is measured: the server runs in this
process), and malformed OOD memory snapshots are the client's error (4xx with one line), never a 500.
"""

from __future__ import annotations

import json

import pytest
import requests

from env_service.manager import EpisodeManager
from env_service.ood_tasks import ood_task_ids
from env_service.service import ServerThread


@pytest.fixture(scope="module")
def service():
    with ServerThread(EpisodeManager(workers=1)) as server:
        yield server


def _create(server, task_id: str, snapshot_json: str) -> requests.Response:
    body = f'{{"task_id": {json.dumps(task_id)}, "mode": "validate", "memory_snapshot": {snapshot_json}}}'
    return requests.post(f"{server.url}/create", data=body, headers={"content-type": "application/json"}, timeout=60)


def _nested(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


@pytest.mark.parametrize(
    "category, snapshot",
    [
        ("memory_kv", '{"core_memory": {}}'),  # a key missing
        ("memory_kv", '{"memory": "x"}'),  # another backend's snapshot
        ("memory_kv", '{"core_memory": [], "archival_memory": {}}'),  # a memory that is not an object
        ("memory_kv", '{"core_memory": {"k": 1}, "archival_memory": {}}'),  # an entry that is not text
        ("memory_kv", '{"core_memory": {"k": %s}, "archival_memory": {}}' % _nested(900)),  # deep: no recursion
        ("memory_rec_sum", '{"memory": 5}'),
        ("memory_rec_sum", '{"memory": null}'),
        ("memory_rec_sum", '{"memory": ["a"]}'),
        ("memory_rec_sum", '{"memory": "ok", "extra": 1}'),
        ("memory_rec_sum", '{"memory": %s}' % _nested(200)),
    ],
)
def test_malformed_memory_snapshots_are_refused_with_one_line(service, category, snapshot):
    question = ood_task_ids(category)[0]  # a question loads the snapshot it is given
    response = _create(service, question, snapshot)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    detail = response.json()["detail"]
    assert "memory_snapshot" in detail and "\n" not in detail and len(detail) < 300, detail


def test_well_formed_and_empty_snapshots_are_taken(service):
    for category, snapshot in [
        ("memory_kv", '{"core_memory": {"name": "Ada"}, "archival_memory": {"pet": "a cat"}}'),
        ("memory_rec_sum", '{"memory": "Ada has a cat."}'),
        ("memory_rec_sum", "{}"),  # bfcl's "no memory yet"
    ]:
        response = _create(service, ood_task_ids(category)[0], snapshot)
        assert response.status_code == 200, response.text[:300]
        instance_id = response.json()["instance_id"]
        assert "Ada" in response.json()["messages"][0]["content"] or snapshot == "{}"
        requests.post(f"{service.url}/release", json={"instance_id": instance_id}, timeout=60)
