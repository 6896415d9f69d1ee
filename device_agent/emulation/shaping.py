"""Bandwidth shaping for emulated devices: a token bucket the transport calls around each chunk.

An emulated Raspberry Pi on Wi-Fi must not upload at loopback speed, or the deadline and the round
time breakdown mean nothing. The transport calls :meth:`TokenBucket.consume` with each chunk's size
before publishing it (uplink) or after receiving it (downlink: blocking the receive callback fills
the broker's QoS 1 in-flight window, so the broker slows down too), and :meth:`TokenBucket.wait_latency`
once per request/response exchange (manifest -> ack), not per chunk, because MQTT pipelines chunks.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` bytes/s on average, bursts of up to ``burst`` bytes, plus a one-way ``latency``.

    A chunk larger than the burst is let through at once and paid for by waiting afterwards (the
    bucket goes into debt), so chunk size never changes the long-run rate. Thread-safe: the paho
    network thread and the agent's main thread may share one bucket per direction.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        *,
        burst_bytes: float | None = None,
        latency_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate_bytes_per_s > 0:
            raise ValueError(
                f"rate must be a positive number of bytes/s (math.inf for unlimited), got {rate_bytes_per_s}"
            )
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {latency_s}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes) if burst_bytes is not None else max(self.rate * 0.05, 1.0)
        if not self.burst > 0:
            raise ValueError(f"burst must be positive, got {burst_bytes}")
        self.latency = latency_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = self.burst
        self._last = clock()

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket and return how long the caller must wait before sending them."""
        if nbytes < 0:
            raise ValueError(f"cannot send a negative number of bytes: {nbytes}")
        if math.isinf(self.rate):
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self.rate)

    def consume(self, nbytes: int) -> float:
        """Block until ``nbytes`` may pass; returns the seconds waited."""
        wait = self.reserve(nbytes)
        if wait > 0:
            self._sleep(wait)
        return wait

    def wait_latency(self) -> None:
        """One exchange's propagation delay."""
        if self.latency > 0:
            self._sleep(self.latency)
