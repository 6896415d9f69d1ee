"""The sender's side of one transfer: what to (re)send, and when it is done. No network, no clock of its own."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator

from device_agent.wire.engine.frames import chunk_frame
from device_agent.wire.engine.manifests import seal
from device_agent.wire.messages import Ack, Manifest, Nack, encode

MAX_BACKOFF = 8
"""The longest silence a sender waits before re-announcing, in units of its ``resend_after``."""
Hasher = Callable[[Callable[[int], bytes], Iterable[int]], Iterator[bytes]]
"""Where outgoing chunks are hashed ahead of their frames: ``Executor.map`` of a pool (the hand-off is the caller's)."""


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

    def start(self, hasher: Hasher | None = None) -> Iterator[bytes]:
        """Everything for a first attempt: the manifest, every chunk in order, then the seal if still due.

        Lazily: hashing and copying chunk i while the network sends chunk i - 1 keeps both off the
        critical path (and a second copy of the payload out of memory). With a ``hasher`` the chunks
        are hashed on its thread, ahead of the frames, while this one copies and publishes.
        """
        announced_sealed = self.manifest.sealed
        yield encode(self.manifest)
        ahead = hasher(self._digest, range(len(self._digests))) if hasher and not announced_sealed else None
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
