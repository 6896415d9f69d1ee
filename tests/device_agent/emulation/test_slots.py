"""A worker's compute slots go to the device that started first, so an overloaded host finishes devices
one after another instead of every device at once, late."""

from __future__ import annotations

import threading
import time

import pytest

from device_agent.emulation.slots import ComputeSlots


def waiting(slots: ComputeSlots, count: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while slots.waiting < count:
        assert time.monotonic() < deadline, "waiters did not queue"
        time.sleep(0.005)


def test_a_freed_slot_goes_to_the_earliest_starter_not_the_first_to_ask() -> None:
    slots = ComputeSlots(1)
    slots.acquire(0.0)
    order: list[str] = []

    def device(name: str, started: float) -> None:
        slots.acquire(started)
        order.append(name)
        slots.release()

    threads = []
    for name, started in (("late", 3.0), ("first", 1.0), ("middle", 2.0)):  # they ask in this order
        threads.append(threading.Thread(target=device, args=(name, started)))
        threads[-1].start()
        waiting(slots, len(threads))
    slots.release()
    for thread in threads:
        thread.join(5)
    assert order == ["first", "middle", "late"]
    assert slots.free == 1


def test_the_earliest_device_runs_its_steps_back_to_back_while_a_later_one_waits() -> None:
    slots = ComputeSlots(1)
    turn_of = {"early": slots.turn(lambda: 1.0), "late": slots.turn(lambda: 2.0)}
    steps: list[str] = []
    early_holds = threading.Event()

    def train(name: str, count: int) -> None:
        for _ in range(count):
            with turn_of[name]:
                early_holds.set()
                steps.append(name)
                time.sleep(0.002)

    early = threading.Thread(target=train, args=("early", 30))
    early.start()
    early_holds.wait(5)
    late = threading.Thread(target=train, args=("late", 5))
    late.start()
    early.join(10)
    late.join(10)
    assert steps[:30].count("early") >= 25  # the later starter gets a turn only when the early one is between steps
    assert steps.count("late") == 5 and slots.free == 1


def test_two_slots_serve_two_devices_at_once_and_zero_is_refused() -> None:
    slots = ComputeSlots(2)
    slots.acquire(5.0)
    slots.acquire(9.0)  # a second free slot: no wait, whatever the priority
    assert slots.free == 0
    slots.release()
    slots.release()
    assert slots.free == 2
    with pytest.raises(ValueError, match="at least one compute slot"):
        ComputeSlots(0)


def test_slots_with_their_own_threads_run_the_work_there_and_hand_back_its_result_or_its_error() -> None:
    """A packed GPU worker's devices compute on the slots' threads: CUDA keeps a handle per computing thread."""
    slots = ComputeSlots(2, own_threads=True)
    try:
        with slots.turn(lambda: 1.0):
            ran_on = slots.run(lambda: threading.current_thread().name)
            with pytest.raises(ZeroDivisionError):
                slots.run(lambda: 1 / 0)
    finally:
        slots.close()
    assert ran_on.startswith("fedfleet-compute") and ran_on != threading.current_thread().name
    in_place = ComputeSlots(1)
    assert in_place.run(lambda: threading.current_thread().name) == threading.current_thread().name
