"""The receiver's side: reassembly, verification, nacks and dedupe of one peer's transfers. No network, no clock."""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from device_agent.wire.engine.frames import chunk_is_intact, transfer_digest
from device_agent.wire.engine.manifests import announced
from device_agent.wire.messages import Ack, Error, Manifest, Message, Nack


@dataclass
class _Incoming:
    """An unfinished transfer. Verified chunks are kept as the buffers they arrived in and joined
    once, when the payload is handed over: no copy of the payload is made before the ack."""

    manifest: Manifest
    chunks: list[bytes | memoryview | None]
    digests: list[bytes | None]
    missing: set[int]
    last_seen: float
    progressed_at: float = 0.0
    """When a chunk or the seal was last taken (or the transfer opened): nacks follow progress, never idle time."""
    nacked_at: float = float("-inf")
    asked: set[int] = field(default_factory=set)
    """What the last nack asked for and has not arrived: once empty, the next missing chunks are asked for."""
    expected: list[bytes] | None = None  # the seal's chunk digests, once it arrived

    def adopt(self, manifest: Manifest) -> int:
        """Take the seal; drops (to be asked for again) the chunks it disagrees with and returns how many."""
        self.manifest = manifest
        self.expected = [bytes.fromhex(d) for d in manifest.chunks or ()]
        dropped = 0
        for index, digest in enumerate(self.digests):
            if digest is not None and digest != self.expected[index]:
                self.chunks[index] = self.digests[index] = None
                self.missing.add(index)
                dropped += 1
        return dropped


class Completed:
    """A complete, verified transfer.

    ``data`` joins the verified chunks on first use, in whichever thread asks (the session's
    dispatcher): the ack then does not wait for a copy of the whole payload on the network thread.
    """

    def __init__(self, manifest: Manifest, chunks: Sequence[bytes | memoryview]) -> None:
        self.manifest = manifest
        self._chunks: Sequence[bytes | memoryview] | None = chunks
        self._data: bytes | None = None
        self._lock = threading.Lock()

    @property
    def data(self) -> bytes:
        with self._lock:
            if self._data is None:
                self._data = b"".join(self._chunks or ())
                self._chunks = None
            return self._data


@dataclass
class ReceiverStats:
    duplicates: int = 0
    corrupt: int = 0
    orphans: int = 0
    late: int = 0
    nacks: int = 0
    completed: int = 0
    expired: int = 0


@dataclass
class IncomingTransfers:
    """The receiver's side for one peer: reassembly, verification, nacks, dedupe of finished transfers.

    ``max_payload_bytes`` bounds one transfer and ``max_pending_bytes`` all unfinished ones, so a
    misbehaving peer cannot make the receiver allocate without limit; ``max_pending_chunks`` bounds
    the per-chunk bookkeeping of unfinished ones (a manifest of 1 GiB in 1-byte chunks would
    otherwise cost a billion-entry list before a byte arrived). Transfers that stay silent for
    ``abandon_after`` seconds are dropped (the sender will re-announce if it is still alive).
    A nack lists at most ``max_nack_chunks`` missing chunks (see the module doc).
    """

    max_payload_bytes: int = 1 << 30
    max_pending_bytes: int = 2 << 30
    max_pending_chunks: int = 1 << 17
    nack_after: float = 1.0
    abandon_after: float = 600.0
    remember_done: int = 4096
    max_nack_chunks: int = 64
    stats: ReceiverStats = field(default_factory=ReceiverStats)
    _open: dict[str, _Incoming] = field(default_factory=dict)
    _done: OrderedDict[str, str] = field(default_factory=OrderedDict)
    # Running totals of the open transfers: a coordinator asks them of every peer for every manifest.
    _open_bytes: int = 0
    _open_chunks: int = 0

    def pending(self) -> list[str]:
        return list(self._open)

    def knows(self, transfer: str) -> bool:
        """Whether ``transfer`` is open or recently finished here (a repeat, not a new transfer)."""
        return transfer in self._open or transfer in self._done

    def pending_bytes(self) -> int:
        return self._open_bytes

    def oldest(self) -> tuple[float, str] | None:
        """(last activity, id) of the unfinished transfer heard from least recently, or None."""
        return min(((t.last_seen, tid) for tid, t in self._open.items()), default=None)

    def drop(self, transfer: str) -> None:
        """Forget an unfinished transfer (the sender re-announces it if it is still alive)."""
        incoming = self._open.pop(transfer, None)
        if incoming is not None:
            self._closed(incoming)

    def drop_where(self, stale: Callable[[Manifest], bool]) -> list[str]:
        """Forget every unfinished transfer whose manifest is ``stale``; their ids."""
        dropped = [tid for tid, incoming in self._open.items() if stale(incoming.manifest)]
        for tid in dropped:
            self.drop(tid)
        return dropped

    def _opened(self, incoming: _Incoming) -> None:
        self._open[incoming.manifest.transfer] = incoming
        self._open_bytes += incoming.manifest.size
        self._open_chunks += incoming.manifest.chunk_count

    def _closed(self, incoming: _Incoming) -> None:
        self._open_bytes -= incoming.manifest.size
        self._open_chunks -= incoming.manifest.chunk_count

    def on_manifest(self, manifest: Manifest, now: float) -> tuple[list[Message], Completed | None]:
        """Start, seal or resume a transfer; answers a repeated manifest with what the sender needs.

        Returns replies to send and, when this manifest completes the transfer, the completed transfer.
        """
        tid = manifest.transfer
        if tid in self._done:
            return [Ack(transfer=tid, digest=self._done[tid])], None
        if manifest.sealed and manifest.digest != transfer_digest(manifest.chunks or []):
            return [
                Error(code="rejected", transfer=tid, detail="manifest digest does not match its chunk digests")
            ], None
        current = self._open.get(tid)
        if current is None:
            if manifest.size > self.max_payload_bytes:
                detail = f"{manifest.size} bytes exceed the receiver's {self.max_payload_bytes}-byte limit"
                return [Error(code="too_large", transfer=tid, detail=detail)], None
            pending = self._open_bytes
            if pending + manifest.size > self.max_pending_bytes:
                detail = f"receiver already holds {pending} bytes of unfinished transfers"
                return [Error(code="too_large", transfer=tid, detail=detail)], None
            count = manifest.chunk_count
            open_chunks = self._open_chunks
            if open_chunks + count > self.max_pending_chunks:
                detail = (
                    f"{count} chunks of {manifest.chunk_size} bytes exceed the receiver's "
                    f"{self.max_pending_chunks - open_chunks} chunks left to track; send bigger chunks"
                )
                return [Error(code="too_large", transfer=tid, detail=detail)], None
            current = _Incoming(manifest, [None] * count, [None] * count, set(range(count)), now, now)
            self._opened(current)
            if manifest.sealed:
                current.adopt(manifest)
            return self._finish(current) if self._complete(current) else ([], None)
        if announced(current.manifest) != announced(manifest):
            error = Error(code="rejected", transfer=tid, detail="manifest differs from the one announced before")
            return [error], None
        current.last_seen = now
        sealing = manifest.sealed and current.expected is None
        if sealing:
            self.stats.corrupt += current.adopt(manifest)
            current.progressed_at = now
        elif manifest.sealed and manifest.digest != current.manifest.digest:
            return [Error(code="rejected", transfer=tid, detail="seal differs from the one received before")], None
        if self._complete(current):
            return self._finish(current)
        if not sealing and now - current.nacked_at < self.nack_after:
            return [], None  # asked a moment ago: a repeated manifest is not answered again
        return [self._nack(current, now)], None

    def on_chunk(
        self,
        transfer: str,
        index: int,
        data: bytes | memoryview,
        digest: bytes,
        now: float,
        intact: bool | None = None,
    ) -> tuple[list[Message], Completed | None]:
        """Take one chunk and the sha256 its frame claims; returns replies and, once, the completed transfer.

        ``intact``: ``chunk_is_intact(data, digest)`` if the caller already checked it outside any lock.
        """
        if transfer in self._done:
            self.stats.late += 1
            return [], None
        incoming = self._open.get(transfer)
        if incoming is None:
            # Before its manifest (reordered or manifest lost): the nack after the manifest asks again.
            self.stats.orphans += 1
            return [], None
        incoming.last_seen = now
        if index not in incoming.missing:
            self.stats.duplicates += 1
            return [], None
        manifest = incoming.manifest
        expected_len = min(manifest.chunk_size, manifest.size - index * manifest.chunk_size)
        if intact is None:
            intact = chunk_is_intact(data, digest)
        sealed_digest = incoming.expected[index] if incoming.expected is not None else digest
        if len(data) != expected_len or not intact or digest != sealed_digest:
            self.stats.corrupt += 1
            return [], None
        # A view into a caller's mutable buffer could change after verification: keep a copy of those.
        incoming.chunks[index] = data if isinstance(data, bytes) or memoryview(data).readonly else bytes(data)
        incoming.digests[index] = digest
        incoming.missing.discard(index)
        incoming.progressed_at = now
        if self._complete(incoming):
            return self._finish(incoming)
        if index in incoming.asked:
            incoming.asked.discard(index)
            if not incoming.asked and incoming.missing:
                return [self._nack(incoming, now)], None  # the last batch is in: ask for the next one
        return [], None

    def poll(self, now: float) -> list[Message]:
        """Nack stalled transfers; drop abandoned ones (their memory with them) and tell their sender.

        Abandoned: no chunk and no seal for ``abandon_after`` seconds. An honest sender answers a nack
        within seconds; one that went silent (or never meant to seal) must not hold the bytes it sent.
        """
        out: list[Message] = []
        for tid, incoming in list(self._open.items()):
            if now - incoming.last_seen > self.abandon_after:
                self.drop(tid)
                self.stats.expired += 1
                detail = f"transfer {tid} expired after {self.abandon_after:g} s without a chunk or its seal"
                out.append(Error(code="unknown_transfer", transfer=tid, detail=f"{detail}; send it again"))
            elif (
                incoming.progressed_at > incoming.nacked_at
                and now - max(incoming.last_seen, incoming.nacked_at) >= self.nack_after
            ):
                out.append(self._nack(incoming, now))
        return out

    def resume(self, transfer: str, now: float) -> Nack:
        """After a reconnect: ask at once for what is still missing, without waiting for ``nack_after``."""
        return self._nack(self._open[transfer], now)

    def _nack(self, incoming: _Incoming, now: float) -> Nack:
        incoming.nacked_at = now
        self.stats.nacks += 1
        missing = heapq.nsmallest(self.max_nack_chunks, incoming.missing)
        incoming.asked = set(missing)
        return Nack(transfer=incoming.manifest.transfer, missing=missing)

    @staticmethod
    def _complete(incoming: _Incoming) -> bool:
        return not incoming.missing and incoming.expected is not None

    def _finish(self, incoming: _Incoming) -> tuple[list[Message], Completed | None]:
        # Every chunk matched the seal's digest for it and the seal's digest matched those digests
        # when it was accepted, so the transfer digest holds by construction.
        manifest = incoming.manifest
        digest = manifest.digest
        assert digest is not None, "only a sealed transfer is complete"
        self.drop(manifest.transfer)
        self._done[manifest.transfer] = digest
        while len(self._done) > self.remember_done:
            self._done.popitem(last=False)
        self.stats.completed += 1
        chunks = [c for c in incoming.chunks if c is not None]
        return [Ack(transfer=manifest.transfer, digest=digest)], Completed(manifest, chunks)
