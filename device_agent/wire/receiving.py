"""The receiver's side of a session: one :class:`IncomingTransfers` per peer, the inbound guard's bounds on new
transfers, and the hand-off of every chunk to the hashing pool.

Each chunk is parsed on the network thread and verified and filed on the process's hashing pool while that
thread reads the next frame; a manifest waits for its transfer's chunks still being verified, so a seal right
after the last chunk finds them filed. Replies and completed payloads leave through the callbacks the session
gives (its carrier and its dispatcher), never under the lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from device_agent.wire import topics
from device_agent.wire.guard import InboundGuard
from device_agent.wire.hashing import shared_pool
from device_agent.wire.messages import Error, Manifest, Message, ProtocolError
from device_agent.wire.transfer import Completed, IncomingTransfers, chunk_is_intact, parse_chunk_frame

log = logging.getLogger("fedfleet.wire")

AWAIT_CHUNKS_S = 10.0
"""Longest a manifest waits on the network thread for its transfer's chunks still being verified."""

Step = Callable[[IncomingTransfers], tuple[list[Message], Completed | None]]


class Receivers:
    """Every peer's incoming transfers, keyed by where that peer is answered (:func:`answered_on`).

    ``reply(topic, replies)`` publishes answers to the peer that sent on ``topic``; ``deliver(topic, completed)``
    hands a complete, verified payload over once; ``wake()`` runs when a transfer opens while ``idle()``.
    ``guard`` (a receiver facing untrusted peers) bounds new transfers per peer and in all.
    """

    def __init__(
        self,
        name: str,
        lock: threading.RLock,
        nack_after_s: float,
        reply: Callable[[str, list[Message]], None],
        deliver: Callable[[str, Completed], None],
        idle: Callable[[], bool],
        wake: Callable[[], None],
        guard: InboundGuard | None = None,
    ) -> None:
        self._name = name
        self._lock = lock
        self._nack_after_s = nack_after_s
        self._reply = reply
        self._deliver = deliver
        self._idle = idle
        self._wake = wake
        self._guard = guard
        self.peers: dict[str, IncomingTransfers] = {}
        self._open: dict[str, IncomingTransfers] = {}
        """The peers with an unfinished transfer (kept by :meth:`_track`): a coordinator's timer and guard ask
        these, not all of its 1,000 peers, several times a second."""
        self._stale: tuple[Callable[[Manifest], bool], str] | None = None
        self._hashing = shared_pool()
        self._verifying: collections.Counter[str] = collections.Counter()
        """Per transfer, its chunks handed to the hashing pool and not yet filed."""
        self._filed = threading.Condition()
        self.stopping = threading.Event()

    def __bool__(self) -> bool:
        return bool(self._open)

    def receiving(self) -> list[str]:
        """Ids of inbound transfers started but not yet complete."""
        with self._lock:
            return [tid for transfers in self._open.values() for tid in transfers.pending()]

    # ---- chunks: parsed on the network thread, verified and filed on the hashing pool ----------------------

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
        self._hashing.verify(len(chunk), lambda: self._file_chunk(topic, transfer, index, chunk, digest, now))
        return True

    def _file_chunk(self, topic: str, transfer: str, index: int, chunk: memoryview, digest: bytes, now: float) -> None:
        """Verify one chunk and file it (on a hashing thread; hashed outside the lock)."""
        try:
            if self.stopping.is_set():
                return
            intact = chunk_is_intact(chunk, digest)
            self._step(topic, lambda r: r.on_chunk(transfer, index, chunk, digest, now, intact))
            if not intact and self._guard is not None:
                detail = f"chunk {index} of transfer {transfer} does not match its digest; asked for again"
                self._guard.refuse(topics.device_of(topic) or topic, "corrupt_chunk", detail, now)
        finally:
            with self._filed:
                self._verifying[transfer] -= 1
                if not self._verifying[transfer]:
                    del self._verifying[transfer]
                    self._filed.notify_all()

    # ---- manifests -------------------------------------------------------------------------------------------

    def take_manifest(self, topic: str, manifest: Manifest, now: float) -> None:
        """Start, seal or resume a transfer once its chunks read before the manifest are filed."""
        self._await_chunks(manifest.transfer)
        self._step(topic, lambda r: self._admit(topic, r, manifest, now))

    def _await_chunks(self, transfer: str) -> None:
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

    def _admit(
        self, topic: str, receiver: IncomingTransfers, manifest: Manifest, now: float
    ) -> tuple[list[Message], Completed | None]:
        """A new transfer past the guard's bounds is refused before the receiver allocates anything for it."""
        refusal = self._stale_refusal(manifest) or self._guard_refusal(topic, receiver, manifest)
        return ([refusal], None) if refusal is not None else receiver.on_manifest(manifest, now)

    def _stale_refusal(self, manifest: Manifest) -> Error | None:
        if self._stale is None or not self._stale[0](manifest):
            return None
        return Error(code="rejected", transfer=manifest.transfer, detail=self._stale[1])

    def _guard_refusal(self, topic: str, mine: IncomingTransfers, manifest: Manifest) -> Error | None:
        """The error answering a new transfer the guard refuses (called under the lock).

        Bounds hold per peer (one receiver each): a new transfer past them evicts the peer's least recently
        active one, so a sender whose old transfers were cut off is not locked out.
        """
        guard = self._guard
        if guard is None or mine.knows(manifest.transfer):
            return None
        peer = topics.device_of(topic) or topic
        now = time.monotonic()
        problem = guard.manifest_problem(manifest)
        held = sum(t.pending_bytes() for t in self._open.values())
        if problem is None and held + manifest.size > guard.limits.max_total_pending_bytes:
            problem = (
                f"the receiver holds {held} bytes of unfinished transfers from all peers (at most "
                f"{guard.limits.max_total_pending_bytes}); send it again later"
            )
        if problem is not None:
            guard.refuse(peer, "transfer_refused", f"transfer {manifest.transfer}: {problem}", now)
            return Error(code="too_large", transfer=manifest.transfer, detail=problem)
        while guard.over(manifest, len(mine.pending()), mine.pending_bytes()) and (oldest := mine.oldest()):
            _seen, tid = oldest
            mine.drop(tid)
            guard.refuse(peer, "transfer_evicted", f"unfinished transfer {tid} dropped for a newer one", now)
        return None

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Answer every new transfer whose manifest is ``stale`` with an error saying ``why`` and drop the
        unfinished ones already open (replaces the last rule). How many unfinished transfers were dropped."""
        with self._lock:
            self._stale = stale, why
            dropped = 0
            for key, transfers in list(self._open.items()):
                dropped += len(transfers.drop_where(stale))
                self._track(key, transfers)
            return dropped

    # ---- one step of a peer's transfers ----------------------------------------------------------------------

    def _step(self, topic: str, step: Step) -> None:
        """One step of ``topic``'s incoming transfers under the lock; replies and hand-over outside it."""
        try:
            key = answered_on(topic)
            with self._lock:
                receiver = self._peer(key)
                replies, completed = step(receiver)
                self._track(key, receiver)
                opened = bool(self._open) and self._idle()
            if opened:
                self._wake()
            if replies:
                self._reply(topic, replies)
            if completed is not None:
                self._deliver(topic, completed)
        except Exception:
            log.exception("%s: error receiving on %s (the session keeps running)", self._name, topic)

    def _peer(self, key: str) -> IncomingTransfers:
        transfers = self.peers.get(key)
        if transfers is None:
            if self._guard is not None:
                transfers = self._guard.limits.receiver(self._nack_after_s)
            else:
                transfers = IncomingTransfers(nack_after=self._nack_after_s)
            self.peers[key] = transfers
        return transfers

    def _track(self, key: str, transfers: IncomingTransfers) -> None:
        """Keep :attr:`_open` current after ``transfers`` changed (called under the lock)."""
        if transfers.pending():
            self._open[key] = transfers
        else:
            self._open.pop(key, None)

    # ---- timer and reconnects --------------------------------------------------------------------------------

    def poll(self, now: float) -> list[tuple[str, Message]]:
        """Nacks of stalled transfers and errors of abandoned ones, with where each is answered."""
        out: list[tuple[str, Message]] = []
        with self._lock:
            for key, transfers in list(self._open.items()):
                out += [(key, reply) for reply in transfers.poll(now)]
                self._track(key, transfers)
        return out

    def resume(self, now: float) -> list[tuple[str, Message]]:
        """After a reconnect: a nack for every unfinished transfer, at once."""
        with self._lock:
            open_ = self._open.items()
            return [(key, transfers.resume(tid, now)) for key, transfers in open_ for tid in transfers.pending()]


def answered_on(topic: str) -> str:
    """Where a peer's transfers on ``topic`` are answered (its opposite ``data`` topic): one key per peer."""
    try:
        return topics.reply_topic(topic)
    except ValueError:
        return topic  # not a device topic: only a session outside the fleet layout sees one
