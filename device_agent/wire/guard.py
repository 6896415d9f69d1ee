"""Admission of inbound frames per peer: rate, transfer bounds and retained messages, before any work.

A receiver that answers everything can be made to amplify (a manifest flood draws a nack per
transfer every few seconds) or to allocate per announced chunk. The guard decides, per peer (the
device a topic belongs to, whatever its sub-topic), whether a frame gets any processing at all:

- every frame passes the peer's budget first (:mod:`device_agent.wire.budget`): control messages of any
  version, well-formed or not, and chunk frames each draw a token; frames past it are dropped unanswered;
- only a device's documented sub-topics (``up/data``, ``up/status``) are read: a frame anywhere else in its
  subtree is refused before it is parsed or leaves any state behind;
- a message of another protocol version is answered ``incompatible`` once per burst, never per message;
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

from device_agent.wire import topics
from device_agent.wire.budget import InboundBudget
from device_agent.wire.engine.incoming import IncomingTransfers
from device_agent.wire.messages import Hello, Manifest, Message, Status

log = logging.getLogger("fedfleet.wire")

RefusalHandler = Callable[[str, str], None]
"""Told (peer, reason) for every refused frame."""

REASONS = frozenset(
    {
        "rate_limited",
        "retained",
        "malformed",
        "wrong_version",
        "wrong_topic",
        "transfer_refused",
        "transfer_evicted",
        "corrupt_chunk",
        "wrong_sender",
    }
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
    """Control messages (and manifests, malformed and wrong-version ones) per second and device."""
    burst: int = 200
    chunk_frames_per_s: float = 4000.0
    """Chunk frames per second and device: 1 GB/s in 256 KiB chunks, beyond any honest device's link."""
    chunk_burst: int = 4096
    """Chunk frames a device may send at once: a whole 1 GiB upload in 256 KiB chunks."""
    max_nack_chunks: int = 64
    """Chunk indexes one nack lists: a nack stays under 600 bytes whatever a manifest announces."""
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
            "chunk_burst",
            "max_nack_chunks",
            "max_total_pending_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("messages_per_s", "chunk_frames_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
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
            max_nack_chunks=self.max_nack_chunks,
        )


@dataclass
class _Burst:
    last: float
    suppressed: int = 0


@dataclass
class InboundGuard:
    """The admission decisions of one receiving session; thread-safe (paho's thread, the session's timer and the
    hashing threads filing its chunks call it)."""

    limits: InboundLimits = field(default_factory=InboundLimits)
    on_refused: RefusalHandler | None = None
    name: str = "receiver"
    _budget: InboundBudget = field(init=False)
    _bursts: dict[tuple[str, str], _Burst] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        limits = self.limits
        self._budget = InboundBudget(limits.messages_per_s, limits.burst, limits.chunk_frames_per_s, limits.chunk_burst)

    def admit_frame(self, topic: str, chunk: bool, now: float) -> str | None:
        """The device a frame comes from if it is to be read at all, else None (refused and counted).

        Every frame is charged to its device's budget before anything else, then its topic must be one of
        the device's documented sub-topics: nothing after this keeps state for a topic it made up.
        """
        peer = topics.device_of(topic) or topic
        if not self._budget.take(peer, chunk, now):
            if chunk:
                rate = f"{self.limits.chunk_frames_per_s:g}/s (burst {self.limits.chunk_burst}) chunk frames"
            else:
                rate = f"{self.limits.messages_per_s:g}/s (burst {self.limits.burst}) messages"
            self.refuse(peer, "rate_limited", f"more than {rate}; dropped unanswered", now)
            return None
        device = topics.uplink_device(topic)
        if device is None:
            self.refuse(peer, "wrong_topic", f"a frame on {topic}, which is no device's up/data or up/status", now)
        return device

    def admit_message(self, peer: str, message: Message | None, retained: bool, now: float) -> bool:
        """Whether a control message or manifest (``message``) or a chunk frame (None) may be retained."""
        if retained and not isinstance(message, RETAINED_KINDS):
            what = "a chunk frame" if message is None else f"a {message.type} message"
            return self.refuse(peer, "retained", f"{what} published retained; only hello and status may be", now)
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
        self.refuse_first(peer, reason, detail, now)
        return False

    def refuse_first(self, peer: str, reason: str, detail: str, now: float) -> bool:
        """Count a refusal and log it if it starts a burst; True when it does (worth one answer to the peer)."""
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
        return True
