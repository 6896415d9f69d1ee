"""The token bucket holds a transfer to its device's link rate."""

from __future__ import annotations

import math
import threading
import time

import pytest

from device_agent.emulation.shaping import TokenBucket

CHUNK = 16 * 1024


def test_the_bucket_lets_a_burst_through_then_paces_to_the_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(1_000_000, burst_bytes=100_000, clock=lambda: now[0], sleep=lambda s: None)
    assert bucket.reserve(100_000) == 0.0  # a full bucket: the first burst is free
    assert bucket.reserve(250_000) == pytest.approx(0.25)  # a chunk larger than the burst goes into debt
    now[0] += 0.25
    assert bucket.reserve(50_000) == pytest.approx(0.05)
    now[0] += 10.0  # idle: the bucket refills, but only up to the burst
    assert bucket.reserve(150_000) == pytest.approx(0.05)


def test_unlimited_and_invalid_rates() -> None:
    assert TokenBucket(math.inf).consume(10**9) == 0.0
    with pytest.raises(ValueError, match="rate must be a positive number of bytes/s"):
        TokenBucket(0)
    with pytest.raises(ValueError, match="latency must be"):
        TokenBucket(1000, latency_s=-1)


def test_measured_rate_of_two_threads_sharing_one_link() -> None:
    rate = 2_000_000
    bucket = TokenBucket(rate, burst_bytes=CHUNK, latency_s=0.02)
    sent = []

    def upload(chunks: int) -> None:
        bucket.wait_latency()
        for _ in range(chunks):
            bucket.consume(CHUNK)
            sent.append(CHUNK)

    bucket.consume(CHUNK)  # drain the initial burst so the timing below is all paced
    start = time.monotonic()
    threads = [threading.Thread(target=upload, args=(20,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start

    measured = sum(sent) / (elapsed - 0.02)
    assert 0.7 * rate < measured < 1.05 * rate
