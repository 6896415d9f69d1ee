"""A per-device inbound budget: every frame a device sends costs a token, whatever the frame is.

Control messages (well-formed or not, of any protocol version) and chunk frames draw on two
token buckets per device, so a flood of any kind is cut before it is parsed, hashed or answered.
Chunk frames get their own, larger bucket: an honest upload is thousands of them in a burst.
State is one pair of buckets per device name, never per topic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


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
class InboundBudget:
    """Two token buckets per device: control messages, and chunk frames; thread-safe."""

    messages_per_s: float
    burst: int
    chunk_frames_per_s: float
    chunk_burst: int
    _buckets: dict[str, tuple[TokenBucket, TokenBucket]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, peer: str, chunk: bool, now: float) -> bool:
        """Spend one of ``peer``'s tokens for a frame (a chunk frame if ``chunk``); False when it has none."""
        with self._lock:
            buckets = self._buckets.get(peer)
            if buckets is None:
                buckets = self._buckets[peer] = (
                    TokenBucket(self.messages_per_s, self.burst),
                    TokenBucket(self.chunk_frames_per_s, self.chunk_burst),
                )
            return buckets[1 if chunk else 0].take(now)

    def peers(self) -> int:
        """How many devices hold buckets (one pair each)."""
        with self._lock:
            return len(self._buckets)
