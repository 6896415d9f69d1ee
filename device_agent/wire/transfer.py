"""Chunked, verified, resumable transfers as pure state machines (no MQTT, no clock of their own).

A sender announces a transfer with a ``Manifest`` (size, chunk size), publishes binary chunk frames
that each carry their chunk's sha256, and seals the transfer with the manifest again, now holding
every chunk digest and the transfer digest over those (a sender that hashed the payload beforehand,
e.g. to send it to many devices, announces it sealed at once). The receiver checks each chunk against
its frame's digest (and the seal's, once known), keeps it, and acks once every chunk is in and the
seal holds. Loss is repaired by asking again, never by trusting a broker's queue:

- the receiver nacks the chunks it still misses when nothing has arrived for ``nack_after`` s since
  the last chunk it took (an empty nack: it has every chunk but no seal, and the sender answers with
  the seal); a nack lists at most ``max_nack_chunks`` indexes, the lowest, and the next ones are asked
  for as soon as those are in. A receiver never nacks a transfer that made no progress since its last
  nack, and answers a repeated manifest with a nack at most once per ``nack_after``: what it sends
  stays within a small multiple of what it receives, whatever a manifest announces;
- the sender re-announces the manifest when it has heard nothing for ``resend_after`` s (a lost
  manifest or a lost ack); a receiver answers a known manifest with a nack or a repeated ack;
- duplicates, chunks of finished transfers and chunks that fail their digest are dropped; chunks
  that disagree with the seal are dropped and asked for again.

Both classes take ``now`` from the caller, so tests drive them with a fake clock and the session
drives them with ``time.monotonic``.

A chunk frame is a 57-byte header followed by the raw bytes (no base64, no JSON):
``b"FFCK" | version (1 byte) | transfer id (16 bytes) | chunk index (uint32, big-endian) | sha256 (32 bytes)``.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from device_agent.wire.messages import Ack, Error, Manifest, Message, Nack, ProtocolError, encode

CHUNK_MAGIC = b"FFCK"
FRAME_VERSION = 2
_HEADER = struct.Struct(">4sB16sI32s")
HEADER_SIZE = _HEADER.size
DEFAULT_CHUNK_SIZE = 256 * 1024
MAX_BACKOFF = 8
"""The longest silence a sender waits before re-announcing, in units of its ``resend_after``."""
# Room for the MQTT fixed header, topic and properties when checking a frame against a packet limit.
PACKET_OVERHEAD = 512


class TransferError(RuntimeError):
    """A transfer that cannot be sent or completed."""


class PayloadTooLarge(TransferError, ValueError):
    """Refused before anything was published: the payload or a frame would exceed a limit."""


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def transfer_digest(chunk_digests: list[str]) -> str:
    """sha256 over the concatenated binary chunk digests: binds every byte, costs almost nothing."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in chunk_digests)).hexdigest()


def is_chunk_frame(data: bytes | memoryview) -> bool:
    return data[:4] == CHUNK_MAGIC


def chunk_frame(transfer: str, index: int, data: bytes | memoryview, digest: bytes | None = None) -> bytes:
    """A frame for ``data``; ``digest`` is its sha256 when the caller has it already."""
    digest = digest if digest is not None else hashlib.sha256(data).digest()
    return _HEADER.pack(CHUNK_MAGIC, FRAME_VERSION, bytes.fromhex(transfer), index, digest) + data


def parse_chunk_frame(frame: bytes | memoryview) -> tuple[str, int, memoryview, bytes]:
    """(transfer id, chunk index, chunk bytes, their claimed sha256) of a frame, or ``ProtocolError``."""
    # Magic and version first: a frame of another version may have another header length.
    if frame[:4] != CHUNK_MAGIC:
        raise ProtocolError(f"not a chunk frame (magic {bytes(frame[:4])!r})")
    if len(frame) > 4 and frame[4] != FRAME_VERSION:
        raise ProtocolError(f"unsupported chunk frame version {frame[4]} (this side speaks {FRAME_VERSION})")
    if len(frame) < HEADER_SIZE:
        raise ProtocolError(f"chunk frame of {len(frame)} bytes is shorter than its {HEADER_SIZE}-byte header")
    _magic, _version, transfer, index, digest = _HEADER.unpack_from(frame)
    return transfer.hex(), index, memoryview(frame)[HEADER_SIZE:], digest


def chunk_is_intact(data: bytes | memoryview, digest: bytes) -> bool:
    """Whether ``data`` hashes to ``digest``; thread-safe and lock-free (hashlib drops the GIL on big buffers)."""
    return hashlib.sha256(data).digest() == digest


@dataclass(frozen=True)
class Limits:
    """What a sender may publish. Checked before the first byte leaves (paho does not check)."""

    max_payload_bytes: int = 1 << 30
    max_packet_bytes: int = 8 * 1024 * 1024

    def check(self, size: int, chunk_size: int) -> None:
        if size > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"payload of {size} bytes exceeds the {self.max_payload_bytes}-byte transfer limit; nothing was sent"
            )
        frame = chunk_size + HEADER_SIZE + PACKET_OVERHEAD
        if frame > self.max_packet_bytes:
            raise PayloadTooLarge(
                f"chunks of {chunk_size} bytes make {frame}-byte packets, over the broker's "
                f"{self.max_packet_bytes}-byte maximum packet size; use a smaller chunk size"
            )


def announce(
    size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    run: str = "",
    round: int = 0,
    kind: str = "payload",
    meta: dict[str, str] | None = None,
    limits: Limits | None = None,
    transfer: str | None = None,
) -> Manifest:
    """An unsealed manifest for ``size`` bytes (nothing hashed yet); refused first if it breaks ``limits``."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    (limits or Limits()).check(size, chunk_size)
    return Manifest(
        transfer=transfer or new_transfer_id(),
        run=run,
        round=round,
        kind=kind,
        size=size,
        chunk_size=chunk_size,
        meta=meta or {},
    )


def seal(manifest: Manifest, chunk_digests: list[bytes]) -> Manifest:
    """``manifest`` carrying the given chunk digests and the transfer digest over them."""
    hexes = [d.hex() for d in chunk_digests]
    return Manifest.model_validate(
        manifest.model_dump() | {"chunks": hexes, "digest": transfer_digest(hexes), "sent_at": time.time()}
    )


def make_manifest(payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE, **fields: Any) -> Manifest:
    """Hash ``payload`` chunk by chunk into a sealed manifest; refuse it first if it breaks ``limits``.

    Takes the keywords of ``announce``. The manifest can be reused to send the same bytes to many
    receivers (``Session.send(..., manifest=)``): only ``transfer`` differs, nothing is rehashed.
    """
    manifest = announce(len(payload), chunk_size, **fields)
    view = memoryview(payload)
    return seal(
        manifest, [hashlib.sha256(view[i : i + chunk_size]).digest() for i in range(0, len(payload), chunk_size)]
    )


def _announced(manifest: Manifest) -> dict[str, Any]:
    """What announcing and sealing a transfer must agree on."""
    return manifest.model_dump(exclude={"sent_at", "chunks", "digest"})


class OutgoingTransfer:
    """The sender's side of one transfer: what to (re)publish, and when it is done.

    ``resend_after``: seconds of silence from the receiver (no ack/nack) after which the manifest is
    re-announced, then twice as long after each unanswered one (at most :data:`MAX_BACKOFF` times); the
    session also calls ``touch`` whenever the broker confirms one of our frames, so a slow link that is
    still draining does not count as silence. After ``max_attempts`` re-announcements without any
    answer the transfer fails.

    An unsealed ``manifest`` is sealed as ``start`` goes: each chunk is hashed just before its frame
    is built, and the seal follows the last chunk.
    """

    def __init__(
        self, manifest: Manifest, payload: bytes, now: float, resend_after: float = 5.0, max_attempts: int = 20
    ) -> None:
        if len(payload) != manifest.size:
            raise ValueError(f"payload has {len(payload)} bytes, manifest says {manifest.size}")
        self.manifest = manifest
        self._payload = memoryview(payload)
        chunks = manifest.chunks or [None] * manifest.chunk_count
        self._digests: list[bytes | None] = [bytes.fromhex(d) if d else None for d in chunks]
        self._resend_after = resend_after
        self._max_attempts = max_attempts
        self._last_heard = now
        self._attempts = 0
        self._resent_at: dict[int, float] = {}
        self.done = False
        self.failed: str | None = None

    @property
    def transfer(self) -> str:
        return self.manifest.transfer

    def _digest(self, index: int) -> bytes:
        digest = self._digests[index]
        if digest is None:
            size = self.manifest.chunk_size
            digest = self._digests[index] = hashlib.sha256(self._payload[index * size : (index + 1) * size]).digest()
        return digest

    def frame(self, index: int) -> bytes:
        size = self.manifest.chunk_size
        return chunk_frame(self.transfer, index, self._payload[index * size : (index + 1) * size], self._digest(index))

    def sealed(self) -> Manifest:
        """The sealed manifest, hashing whatever chunk was not hashed yet."""
        if not self.manifest.sealed:
            self.manifest = seal(self.manifest, [self._digest(i) for i in range(len(self._digests))])
        return self.manifest

    def start(self, hasher: Executor | None = None) -> Iterator[bytes]:
        """Everything for a first attempt: the manifest, every chunk in order, then the seal if still due.

        Lazily: hashing and copying chunk i while the network sends chunk i - 1 keeps both off the
        critical path (and a second copy of the payload out of memory). With a ``hasher`` the chunks
        are hashed on its thread, ahead of the frames, while this one copies and publishes.
        """
        announced_sealed = self.manifest.sealed
        yield encode(self.manifest)
        ahead = hasher.map(self._digest, range(len(self._digests))) if hasher and not announced_sealed else None
        for index in range(len(self._digests)):
            if ahead is not None:
                next(ahead)  # chunk ``index`` is hashed; usually long since
            yield self.frame(index)
        if not announced_sealed:
            yield encode(self.sealed())

    def touch(self, now: float) -> None:
        """Evidence the transfer is progressing (the broker took a frame); postpones re-announcing."""
        self._last_heard = max(self._last_heard, now)

    def on_ack(self, ack: Ack) -> bool:
        """True when this ack completes the transfer; a digest mismatch fails it loudly."""
        if self.done or self.failed:
            return False
        if ack.digest != self.manifest.digest:
            self.failed = f"receiver acked digest {ack.digest}, expected {self.manifest.digest}"
            return False
        self.done = True
        return True

    def on_nack(self, nack: Nack, now: float) -> list[bytes]:
        """Frames to resend; a chunk resent less than ``resend_after`` ago is not resent again."""
        self._last_heard = now
        self._attempts = 0
        if self.done or self.failed:
            return []
        if not nack.missing:
            return [encode(self.sealed())]  # the receiver has every chunk but lost the seal
        out = []
        for index in sorted(set(nack.missing)):
            if index >= len(self._digests):
                continue
            if now - self._resent_at.get(index, float("-inf")) < self._resend_after:
                continue
            self._resent_at[index] = now
            out.append(self.frame(index))
        return out

    def resume(self, now: float) -> list[bytes]:
        """After a reconnect: re-announce at once, the receiver will nack what it lacks."""
        self._last_heard = now
        self._resent_at.clear()
        return [] if self.done or self.failed else [encode(self.manifest)]

    def poll(self, now: float) -> list[bytes]:
        """Called periodically: re-announce after silence, give up after too many tries.

        Each unanswered re-announcement doubles the silence before the next (up to
        :data:`MAX_BACKOFF` times ``resend_after``): a receiver that is behind, not gone, is not flooded
        with repeats by every sender at once, which would only put it further behind.
        """
        silence = self._resend_after * min(2**self._attempts, MAX_BACKOFF)
        if self.done or self.failed or now - self._last_heard < silence:
            return []
        self._attempts += 1
        if self._attempts > self._max_attempts:
            self.failed = f"no answer from the receiver after {self._max_attempts} re-announcements"
            return []
        self._last_heard = now
        return [encode(self.manifest)]


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
        if _announced(current.manifest) != _announced(manifest):
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
