"""The process's hashing threads, shared by every session in it.

Two kinds of work run here: outgoing chunks hashed ahead of their frames (``Session.send`` without a
manifest, through the ``Executor`` interface), and inbound chunks verified and filed off paho's network
thread, which reads the next frame meanwhile (:meth:`HashingPool.verify`). A coordinator taking many uploads
at once is bound by that thread: hashing each chunk on it left the other cores idle while it hashed.

Inbound work goes on a plain queue, without a future: nothing waits for it, and a ``ThreadPoolExecutor``'s
future, work item and wake-up per 256 KiB chunk cost the fan-in benchmark ~0.03 of its ratio on 2 cores.
One pool per process, not per session: an emulation worker hosts hundreds of sessions, and a pool each
cost the worker ~750 idle threads per 250 devices, and their stacks, for work that fits :data:`THREADS`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

log = logging.getLogger("fedfleet.wire")
T = TypeVar("T")

THREADS = max(2, min(8, os.cpu_count() or 1))
"""One per core (hashing is CPU-bound and hashlib releases the GIL), at least two so one slow chunk never
idles the rest."""
QUEUED_BYTES = 16 * 2**20
"""Most bytes of inbound chunks waiting for a hashing thread, process-wide. Past it a network thread waits
before it reads on, so TCP pushes back on the broker, as it should on a receiver that cannot keep up."""


class HashingPool(Executor):
    """Daemon threads taking work off one queue; inbound work is bounded by the bytes it waits to hash."""

    def __init__(self, threads: int = THREADS, queued_bytes: int = QUEUED_BYTES) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._limit = queued_bytes
        self._queued = 0
        self._room = threading.Condition()
        self._threads = [
            threading.Thread(target=self._serve, name=f"fedfleet-sha256-{index}", daemon=True)
            for index in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def queued_bytes(self) -> int:
        """Bytes of inbound chunks handed to :meth:`verify` and not yet done with."""
        return self._queued

    def verify(self, size: int, work: Callable[[], None]) -> None:
        """Run ``work`` (verifying ``size`` bytes) on a pool thread; wait first for room under the bound.

        One item always fits, however large. ``work`` must never wait for the caller's thread: the caller
        may be the one waiting here.
        """
        with self._room:
            while self._queued and self._queued + size > self._limit:
                self._room.wait()
            self._queued += size
        self._put(lambda: self._verify(size, work))

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """``Executor.submit``: outgoing hashing, which the sender waits for (``Executor.map``)."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        self._put(run)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads once the work queued so far is done (``cancel_futures`` is not supported)."""
        threads, self._threads = self._threads, []
        for _thread in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def _put(self, work: Callable[[], None]) -> None:
        if not self._threads:
            raise RuntimeError("the hashing pool was shut down")
        self._work.put(work)

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            work()

    def _verify(self, size: int, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception:  # nothing waits for it: say it here or nowhere
            log.exception("error verifying an inbound chunk (the session keeps running)")
        finally:
            with self._room:
                self._queued -= size
                self._room.notify_all()


_shared: HashingPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> HashingPool:
    """The process's one pool, made (and its threads started) by the first session."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = HashingPool()
        return _shared
