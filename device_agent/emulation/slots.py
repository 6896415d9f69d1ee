"""A worker's compute slots, handed out to the device that started its round's work first.

The devices packed into one worker take turns computing, one step at a time. With a plain semaphore the
turns go round-robin: on a host that cannot carry every device within the deadline, every device is
90 % done when the deadline passes and the round gets no update at all. Handing a freed slot to the
waiting device that started earliest makes the devices finish one after another instead: an overloaded
host delivers the updates it can carry, in time, and the rest late. A device sleeping off its device
time (:class:`~device_agent.emulation.limits.Throttle`) holds no slot, so slowed devices still overlap.

On a GPU the slots also own the threads the work runs on (``own_threads``): CUDA libraries keep a handle
and a workspace per calling thread (cuBLAS, cuDNN), so a worker whose device threads each ran their own
steps held one set per device (3-7 GB of GPU memory per worker of 64 at 1,000 devices on an H100, and the
GPU filled up; about 97 MiB a thread on an H200). A device still waits for its turn on its own thread,
then hands the step's body to a slot's thread and waits for the result. On a CPU the hop would only add
latency, so the body runs in place.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")


class ComputeSlots:
    """``slots`` turns at a time; a freed one goes to the waiter with the lowest priority value.

    A releasing device that asks again at once with a lower value than every waiter gets its slot back
    (no hand-over to a later starter), which is what lets the earliest device run its steps back to back.
    """

    def __init__(self, slots: int, *, own_threads: bool = False) -> None:
        """``own_threads``: :meth:`run` runs work on one of ``slots`` threads of this object (for CUDA)."""
        if slots < 1:
            raise ValueError(f"a worker needs at least one compute slot, got {slots}")
        self._threads = ThreadPoolExecutor(slots, thread_name_prefix="fedfleet-compute") if own_threads else None
        self._free = slots
        self._lock = threading.Lock()
        self._waiting: list[tuple[float, int, threading.Event]] = []
        self._tickets = itertools.count()

    @property
    def free(self) -> int:
        """Slots no device holds right now."""
        return self._free

    @property
    def waiting(self) -> int:
        """Devices waiting for a slot right now."""
        return len(self._waiting)

    def acquire(
        self, priority: float, *, wake: threading.Event | None = None, give_up: Callable[[], bool] | None = None
    ) -> bool:
        """Wait for a slot; True once held. With ``give_up``: False as soon as it is true (checked when ``wake``,
        set through :meth:`wake`, wakes this waiter), without a slot: another device did this one's work."""
        with self._lock:
            if give_up is not None and give_up():
                return False
            if self._free > 0 and (not self._waiting or priority < self._waiting[0][0]):
                self._free -= 1
                return True
            entry = (priority, next(self._tickets), wake or threading.Event())
            heapq.heappush(self._waiting, entry)
        while True:
            entry[2].wait()
            with self._lock:
                if give_up is not None and give_up():
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                    self._wake_first()
                    return False
                if self._free > 0 and self._waiting[0] is entry:
                    heapq.heappop(self._waiting)
                    self._free -= 1
                    self._wake_first()
                    return True
                entry[2].clear()

    def wake(self, event: threading.Event) -> None:
        """Wake a waiter of :meth:`acquire` whose ``give_up`` may now be true (under the lock: no lost wake-up)."""
        with self._lock:
            event.set()

    def release(self) -> None:
        with self._lock:
            self._free += 1
            self._wake_first()

    def _wake_first(self) -> None:
        if self._free > 0 and self._waiting:
            self._waiting[0][2].set()

    def run(self, work: Callable[[], T]) -> T:
        """``work()`` on a slot's own thread if the slots have threads, else here; its result or its exception.

        Call it holding a turn: at most ``slots`` devices do, so a slot thread is always free.
        """
        if self._threads is None:
            return work()
        return self._threads.submit(work).result()

    def close(self) -> None:
        """Stop the slots' threads (after the last :meth:`run`)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)

    def turn(self, priority: Callable[[], float]) -> Turn:
        """A reusable context manager for one device: each ``with`` waits for a slot at ``priority()``."""
        return Turn(self, priority)


class Turn:
    """One device's way into its worker's :class:`ComputeSlots` (``with turn: <one step>``)."""

    def __init__(self, slots: ComputeSlots, priority: Callable[[], float]) -> None:
        self._slots = slots
        self._priority = priority

    def __enter__(self) -> None:
        self._slots.acquire(self._priority())

    def run(self, work: Callable[[], T]) -> T:
        """``work`` where this turn's slots run it (see :meth:`ComputeSlots.run`); call it inside the turn."""
        return self._slots.run(work)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._slots.release()


__all__ = ["ComputeSlots", "Turn"]
