"""Admission of inbound frames per peer: rate, transfer bounds and retained messages, before any work.

A receiver that answers everything can be made to amplify (a manifest flood draws a nack per
transfer every few seconds) or to allocate per announced chunk. The guard decides, per peer (the
device a topic belongs to, whatever its sub-topic), whether a frame gets any processing at all:

- control messages and manifests pass a token bucket per peer; frames past it are dropped unanswered;
- a new transfer must fit bounds on size, chunk count, chunk size, open transfers and pending bytes;
- retained messages are dropped unless their kind is meant to be retained (hello, status): a peer
  must not leave a manifest or a chunk on the broker for a restarted receiver to pick up.

A refusal is logged once per burst (the first, then a count when the peer has been quiet for
``quiet_s``), never per frame, and handed to ``on_refused(peer, reason)`` for counting.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from device_agent.wire.messages import Hello, Manifest, Message, Status
from device_agent.wire.transfer import IncomingTransfers

log = logging.getLogger("fedfleet.wire")

RefusalHandler = Callable[[str, str], None]
"""Told (peer, reason) for every refused frame."""

REASONS = frozenset(
    {"rate_limited", "retained", "malformed", "transfer_refused", "transfer_evicted", "corrupt_chunk", "wrong_sender"}
)
"""Every reason the transport refuses a frame under (the engine adds its own: ``coordinator.rounds.upload_gate``)."""

RETAINED_KINDS: tuple[type, ...] = (Hello, Status)
"""Messages a peer publishes retained on purpose (see ``device_agent.wire.protocol``)."""


@dataclass(frozen=True)
class InboundLimits:
    """Per-peer bounds; the defaults leave room for a ResNet-sized update and several resends."""

    max_transfer_bytes: int = 1 << 30
    max_pending_bytes: int = 1 << 30
    max_open_transfers: int = 4
    """Beyond this, a new transfer evicts the peer's least recently active one (an honest sender re-announces)."""
    max_chunks: int = 1 << 16
    min_chunk_bytes: int = 1024
    """Unless the transfer is one chunk: tiny chunks make the receiver keep a slot per few bytes."""
    messages_per_s: float = 50.0
    burst: int = 200
    quiet_s: float = 10.0
    """A burst of refusals ends after this long without one; the next refusal is logged again."""
    idle_s: float = 60.0
    """An unfinished transfer with no chunk and no seal for this long is dropped and its sender told."""
    max_total_pending_bytes: int = 4 << 30
    """Bytes all peers together may hold in unfinished transfers: k compromised devices cannot hold k GiB."""

    def __post_init__(self) -> None:
        for name in (
            "max_transfer_bytes",
            "max_pending_bytes",
            "max_open_transfers",
            "max_chunks",
            "burst",
            "max_total_pending_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.messages_per_s <= 0:
            raise ValueError(f"messages_per_s must be > 0, got {self.messages_per_s}")
        if self.idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {self.idle_s}")

    def receiver(self, nack_after: float) -> IncomingTransfers:
        """One peer topic's reassembly, bounded by these limits: it never refuses a transfer the guard admitted.

        The guard holds a peer to at most ``max_open_transfers`` of at most ``max_chunks`` chunks each, across
        all its topics, so the receiver's own bounds follow from the guard's instead of being set twice.
        """
        return IncomingTransfers(
            max_payload_bytes=self.max_transfer_bytes,
            max_pending_bytes=self.max_pending_bytes,
            max_pending_chunks=self.max_open_transfers * self.max_chunks,
            nack_after=nack_after,
            abandon_after=self.idle_s,
        )


@dataclass
class TokenBucket:
    """``rate`` tokens per second up to ``capacity``; ``take`` spends one if there is one."""

    rate: float
    capacity: float
    tokens: float = -1.0
    stamp: float = 0.0

    def take(self, now: float) -> bool:
        if self.tokens < 0:
            self.tokens, self.stamp = self.capacity, now
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class _Burst:
    last: float
    suppressed: int = 0


@dataclass
class InboundGuard:
    """The admission decisions of one receiving session; thread-safe (paho's and the receive thread call it)."""

    limits: InboundLimits = field(default_factory=InboundLimits)
    on_refused: RefusalHandler | None = None
    name: str = "receiver"
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)
    _bursts: dict[tuple[str, str], _Burst] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit_message(self, peer: str, message: Message | None, retained: bool, now: float) -> bool:
        """Whether a control message or manifest (``message``) or a chunk frame (None) gets processed."""
        if retained and not isinstance(message, RETAINED_KINDS):
            what = "a chunk frame" if message is None else f"a {message.type} message"
            return self.refuse(peer, "retained", f"{what} published retained; only hello and status may be", now)
        if message is None:
            return True
        with self._lock:
            bucket = self._buckets.setdefault(peer, TokenBucket(self.limits.messages_per_s, self.limits.burst))
            allowed = bucket.take(now)
        if not allowed:
            rate = f"{self.limits.messages_per_s:g}/s (burst {self.limits.burst})"
            return self.refuse(peer, "rate_limited", f"more than {rate} messages; dropped unanswered", now)
        return True

    def manifest_problem(self, manifest: Manifest) -> str | None:
        """Why a new transfer is refused whatever else the peer has open, or None."""
        limits = self.limits
        most = min(limits.max_transfer_bytes, limits.max_pending_bytes)
        if manifest.size > most:
            return f"{manifest.size} bytes exceed the {most}-byte transfer limit"
        if manifest.chunk_count > limits.max_chunks:
            return f"{manifest.chunk_count} chunks exceed the limit of {limits.max_chunks}"
        if manifest.chunk_count > 1 and manifest.chunk_size < limits.min_chunk_bytes:
            return f"chunks of {manifest.chunk_size} bytes are below the {limits.min_chunk_bytes}-byte minimum"
        return None

    def over(self, manifest: Manifest, open_transfers: int, pending_bytes: int) -> bool:
        """Whether admitting ``manifest`` next to the peer's unfinished transfers breaks a per-peer bound."""
        limits = self.limits
        return open_transfers >= limits.max_open_transfers or pending_bytes + manifest.size > limits.max_pending_bytes

    def refuse(self, peer: str, reason: str, detail: str, now: float) -> bool:
        """Count a refusal and log it if it starts a burst; returns False (not admitted)."""
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        if self.on_refused is not None:
            self.on_refused(peer, reason)
        with self._lock:
            burst = self._bursts.get((peer, reason))
            if burst is not None and now - burst.last < self.limits.quiet_s:
                burst.last, burst.suppressed = now, burst.suppressed + 1
                return False
            suppressed = burst.suppressed if burst is not None else 0
            self._bursts[(peer, reason)] = _Burst(now)
        earlier = f" ({suppressed} more were refused in the previous burst)" if suppressed else ""
        log.warning(
            "%s: refusing input from %s (%s): %s; further refusals of this kind are not logged until it has been "
            "quiet for %g s%s",
            self.name,
            peer,
            reason,
            detail,
            self.limits.quiet_s,
            earlier,
        )
        return False
