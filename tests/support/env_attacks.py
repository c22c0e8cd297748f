"""What the env-service chaos tests send: the env benchmark's exploit builders (``benchmarks/env_service.py``, which
replays them too), episodes placed on two workers, and big accepted files that fill a client's kept bytes."""

from __future__ import annotations

import json
import time

from tests.support.processes import repo_script

#: ``benchmarks/env_service.py``, home of the exploit's message builder (the benchmark replays it too).
BENCHMARK = repo_script("benchmarks/env_service.py")


call, aliasing_messages = BENCHMARK._call, BENCHMARK.aliasing_messages


def worker_of(service, instance_id: str):
    return next(w for w in service.manager._pool._workers if instance_id in w.episodes)


def episodes_on_two_workers(client, service, first_task: str, second_task: str) -> tuple[str, str]:
    """Two live episodes on different workers. Placement picks the calm worker (not busy over most of the last few
    seconds) holding the fewest episodes, so a second episode may land beside the first: a worker just replaced or
    slowed by a loaded machine, or episodes an earlier test left. Each such one is held, which tips the count to the
    other worker, and released once it is found (bounded)."""
    first = client.create(first_task, "validate")["instance_id"]
    beside = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            second = client.create(second_task, "validate")["instance_id"]
            if worker_of(service, second) is not worker_of(service, first):
                return first, second
            beside.append(second)
            time.sleep(0.3)
        pool, now = service.manager._pool, time.monotonic()
        held = [(len(w.episodes), round(pool._busy_share(w, now), 2)) for w in pool._workers]
        raise AssertionError(f"no episode was placed on the second worker in 30 s; (episodes, busy share): {held}")
    finally:
        for instance_id in beside:
            assert client.release(instance_id)


BIG_TEXT = "x" * 200_000


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def big_file(k: int) -> str:
    """One accepted message that keeps ~200 KB three times: its arguments (the verifier replays them), the file in
    the backend state, and the message in the service (a replay after a worker loss rebuilds the episode from it)."""
    return tool_call("touch", file_name=f"f{k}.txt") + tool_call("echo", content=BIG_TEXT, file_name=f"f{k}.txt")
