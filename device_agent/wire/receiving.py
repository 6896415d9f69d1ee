"""The hashing hand-off of a receiving session: each chunk frame is parsed on paho's network thread, then verified
on the process's hashing pool while that thread reads the next frame, and filed into the transfer engine there.

A manifest waits for its transfer's chunks still being verified, so a seal right after the last chunk finds them
filed (:meth:`ChunkIntake.await_chunks`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from device_agent.wire import topics
from device_agent.wire.engine.frames import chunk_is_intact, parse_chunk_frame
from device_agent.wire.guard import InboundGuard
from device_agent.wire.hashing import shared_pool
from device_agent.wire.messages import ProtocolError

log = logging.getLogger("fedfleet.wire")

AWAIT_CHUNKS_S = 10.0
"""Longest a manifest waits on the network thread for its transfer's chunks still being verified."""

FileChunk = Callable[[str, str, int, memoryview, bytes, float, bool], None]
"""Files one verified (or not: the last argument says) chunk: topic, transfer, index, bytes, digest, now, intact."""


class ChunkIntake:
    """Chunk frames from the network thread to ``file`` on a hashing thread, and who waits for them.

    ``guard`` (a receiver facing untrusted peers) is told of malformed frames and corrupt chunks.
    """

    def __init__(self, name: str, file: FileChunk, guard: InboundGuard | None = None) -> None:
        self._name = name
        self._file = file
        self._guard = guard
        self._hashing = shared_pool()
        self._verifying: collections.Counter[str] = collections.Counter()
        """Per transfer, its chunks handed to the hashing pool and not yet filed."""
        self._filed = threading.Condition()
        self.stopping = threading.Event()

    def take_chunk(self, topic: str, frame: bytes | memoryview, now: float) -> bool:
        """Parse one chunk frame and hand it to the hashing pool; False if it was malformed (and dropped)."""
        try:
            transfer, index, chunk, digest = parse_chunk_frame(frame)
        except ProtocolError as exc:
            if self._guard is not None:
                self._guard.refuse(topics.device_of(topic) or topic, "malformed", f"on {topic}: {exc}", now)
            else:
                log.warning("%s: rejected a message on %s: %s", self._name, topic, exc)
            return False
        with self._filed:
            self._verifying[transfer] += 1
        self._hashing.verify(len(chunk), lambda: self._verify(topic, transfer, index, chunk, digest, now))
        return True

    def _verify(self, topic: str, transfer: str, index: int, chunk: memoryview, digest: bytes, now: float) -> None:
        """Verify one chunk and file it (on a hashing thread; hashed outside any lock)."""
        try:
            if self.stopping.is_set():
                return
            intact = chunk_is_intact(chunk, digest)
            self._file(topic, transfer, index, chunk, digest, now, intact)
            if not intact and self._guard is not None:
                detail = f"chunk {index} of transfer {transfer} does not match its digest; asked for again"
                self._guard.refuse(topics.device_of(topic) or topic, "corrupt_chunk", detail, now)
        finally:
            with self._filed:
                self._verifying[transfer] -= 1
                if not self._verifying[transfer]:
                    del self._verifying[transfer]
                    self._filed.notify_all()

    def await_chunks(self, transfer: str) -> None:
        """Wait until ``transfer``'s chunks read before its manifest are filed: a seal that found its last chunks
        still being verified would nack them, and its sender would send them again.

        At most :data:`AWAIT_CHUNKS_S`: past it the manifest goes on (its nack costs resends, not a transfer),
        so a hashing pool that stopped keeping up never stops this connection's reading for good.
        """
        with self._filed:
            if not self._filed.wait_for(lambda: not self._verifying[transfer], AWAIT_CHUNKS_S):
                log.warning(
                    "%s: %d chunk(s) of transfer %s still waited for verification after %.0f s; its manifest goes on",
                    self._name,
                    self._verifying[transfer],
                    transfer,
                    AWAIT_CHUNKS_S,
                )
