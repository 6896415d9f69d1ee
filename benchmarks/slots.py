"""Compute slot policy on an overloaded worker: how many devices finish by the deadline.

    python -m benchmarks.slots [--devices 32] [--steps 20] [--step-ms 10] [--load 2] [--json]

``devices`` threads each run ``steps`` steps of ``step_ms`` of torch work (one thread, releasing the
GIL as a training step does) through one compute slot,
all starting together (a round's assignments arrive at once), against a deadline of 1/``load`` of
the total work: the host can carry half the round at load 2. Side by side in one run: a plain
semaphore (turns go round-robin, what packed workers used before) and
:class:`~device_agent.emulation.slots.ComputeSlots` (a freed slot goes to the earliest starter).
Keys: ``finished_round_robin`` and ``finished_earliest_first`` (devices done by the deadline),
``median_finish_s_*`` and ``deadline_s``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from benchmarks.output import print_result
from device_agent.emulation.slots import ComputeSlots


def busy(seconds: float) -> None:
    """About ``seconds`` of torch work, which releases the GIL as a training step does."""
    a = torch.randn(128, 128)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def run_policy(
    turn_for: Callable[[float], AbstractContextManager[object]], devices: int, steps: int, step_s: float
) -> list[float]:
    """Seconds from the common start until each device finished its steps."""
    start = time.perf_counter()
    finished: list[float] = []
    lock = threading.Lock()

    def device(index: int) -> None:
        started = start + index * 1e-6  # assignment order: the earliest-first policy's priority
        turn = turn_for(started)
        for _ in range(steps):
            with turn:
                busy(step_s)
        with lock:
            finished.append(time.perf_counter() - start)

    threads = [threading.Thread(target=device, args=(i,)) for i in range(devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return finished


def measure(devices: int, steps: int, step_ms: float, load: float) -> dict[str, Any]:
    step_s = step_ms / 1000
    deadline = devices * steps * step_s / load
    semaphore = threading.BoundedSemaphore(1)
    round_robin = run_policy(lambda _started: semaphore, devices, steps, step_s)
    slots = ComputeSlots(1)
    earliest = run_policy(lambda started: slots.turn(lambda: started), devices, steps, step_s)
    return {
        "devices": devices,
        "steps": steps,
        "step_ms": step_ms,
        "deadline_s": round(deadline, 3),
        "finished_round_robin": sum(t <= deadline for t in round_robin),
        "finished_earliest_first": sum(t <= deadline for t in earliest),
        "median_finish_s_round_robin": round(statistics.median(round_robin), 3),
        "median_finish_s_earliest_first": round(statistics.median(earliest), 3),
        "last_finish_s_round_robin": round(max(round_robin), 3),
        "last_finish_s_earliest_first": round(max(earliest), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.slots",
        description="Devices finished by the deadline on an overloaded worker: round-robin vs earliest-first slots.",
    )
    parser.add_argument("--devices", type=int, default=32, help="devices in the worker (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="steps each device trains (default: %(default)s)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="CPU work per step (default: %(default)s)")
    parser.add_argument(
        "--load", type=float, default=2.0, help="total work / deadline: 2 = the host carries half (default: 2)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a worker's slot computes with its own threads, one by default
    result = measure(args.devices, args.steps, args.step_ms, args.load)
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
