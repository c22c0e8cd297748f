"""The worker gate: one request at a time, handed on to the waiting request whose owner used the workers least."""

from __future__ import annotations

import threading
import time

import pytest

from env_service.workers.fair_gate import FairGate, Usage


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_usage_decays_with_its_half_life():
    clock = Clock()
    usage = Usage(half_life_s=10.0, clock=clock)
    usage.charge("a", 8.0)
    clock.now += 10.0
    assert usage.of("a") == pytest.approx(4.0)
    usage.charge("a", 1.0)
    clock.now += 20.0
    assert usage.of("a") == pytest.approx(5.0 / 4)
    assert usage.of("never charged") == 0.0


def test_the_lightest_owner_is_first_and_ties_go_to_the_earliest():
    clock = Clock()
    usage = Usage(half_life_s=30.0, clock=clock)
    usage.charge("heavy", 5.0)
    usage.charge("light", 0.01)
    assert usage.lightest(["heavy", "light", "heavy"]) == 1
    assert usage.lightest(["new", "other new", "light"]) == 0


def _queue(gate: FairGate, owners: list[str]) -> tuple[list[str], list[threading.Thread]]:
    """Threads that wait for ``gate`` (held) in the order of ``owners``; each records its owner when served."""
    served: list[str] = []

    def wait_then_record(owner: str) -> None:
        assert gate.acquire(owner, timeout=10)
        served.append(owner)
        gate.release()

    threads = []
    for owner in owners:
        threads.append(threading.Thread(target=wait_then_record, args=(owner,)))
        threads[-1].start()
        while gate.waiting() < len(threads):  # arrival order is the order of owners
            time.sleep(0.001)
    return served, threads


def test_waiting_requests_are_served_lightest_owner_first_not_in_arrival_order():
    usage = Usage()
    usage.charge("hostile", 8.0)  # 8 budget-busting messages lately
    usage.charge("trainer", 0.05)
    gate = FairGate(usage)
    assert gate.acquire("hostile")
    served, threads = _queue(gate, ["hostile", "hostile", "trainer", "hostile", "trainer"])
    gate.release()
    for thread in threads:
        thread.join(10)
    assert served[:2] == ["trainer", "trainer"]  # a plain lock served them in arrival order (or any order)
    assert sorted(served) == ["hostile"] * 3 + ["trainer"] * 2


def test_the_gate_is_handed_over_so_no_newcomer_slips_in():
    gate = FairGate(Usage())
    assert gate.acquire("a")
    served, threads = _queue(gate, ["b"])
    gate.release()  # handed to b: it stays held until b releases
    threads[0].join(10)
    assert served == ["b"]
    assert gate.try_acquire()  # b released: free again
    assert not gate.try_acquire()
    gate.release()


def test_a_wait_that_times_out_leaves_the_queue():
    gate = FairGate(Usage())
    assert gate.acquire("a")
    started = time.monotonic()
    assert not gate.acquire("b", timeout=0.2)
    assert time.monotonic() - started >= 0.2
    assert gate.waiting() == 0
    gate.release()
    assert gate.try_acquire()
