"""Unfinished transfers expire: a sender that stops (or never seals) cannot hold the receiver's memory.

Five 8 MiB transfers filled with real chunks and never sealed are dropped after ``abandon_after``
seconds without a chunk, their bytes freed, and each sender is told; and all peers together cannot
hold more than the guard's ``max_total_pending_bytes`` in unfinished transfers.
"""

from __future__ import annotations

import gc
import hashlib
import os
import tracemalloc

import pytest

from device_agent.wire.guard import InboundGuard, InboundLimits
from device_agent.wire.messages import Error, Message
from device_agent.wire.session import coordinator_session, device_session
from device_agent.wire.transfer import IncomingTransfers, announce
from tests.waiting import until

CHUNK = 256 * 1024
SIZE = 8 << 20


def _fill_unsealed(receiver: IncomingTransfers, now: float) -> str:
    manifest = announce(SIZE, CHUNK, kind="update")
    receiver.on_manifest(manifest, now)
    for index in range(manifest.chunk_count):
        chunk = os.urandom(CHUNK)
        receiver.on_chunk(manifest.transfer, index, chunk, hashlib.sha256(chunk).digest(), now)
    return manifest.transfer


def test_unsealed_transfers_expire_free_their_memory_and_tell_the_sender() -> None:
    receiver = IncomingTransfers(abandon_after=1.0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    transfers = [_fill_unsealed(receiver, now=0.0) for _ in range(5)]
    held = tracemalloc.get_traced_memory()[0] - before
    assert held > 0.8 * 5 * SIZE, f"only {held} bytes held for 5 x {SIZE}"
    assert sorted(receiver.pending()) == sorted(transfers)

    assert receiver.poll(now=0.5) == [] and len(receiver.pending()) == 5  # not idle long enough yet: kept
    replies = receiver.poll(now=2.0)
    gc.collect()
    freed = held - (tracemalloc.get_traced_memory()[0] - before)
    tracemalloc.stop()

    assert receiver.pending() == [] and receiver.pending_bytes() == 0
    expired = {r.transfer: r for r in replies if isinstance(r, Error)}
    assert sorted(expired) == sorted(transfers)
    assert all(r.code == "unknown_transfer" and "expired after 1 s" in r.detail for r in expired.values())
    assert receiver.stats.expired == 5
    assert freed > 0.8 * held, f"{freed} of {held} bytes freed"


@pytest.mark.slow
def test_all_peers_together_cannot_hold_more_than_the_total_cap(fresh_mosquitto) -> None:
    broker = fresh_mosquitto
    # dev-b must be refused while dev-a's transfer is held: idle_s is that window, wide enough for a loaded host.
    limits = InboundLimits(max_total_pending_bytes=6 << 20, idle_s=4.0)
    refused: list[tuple[str, str]] = []
    guard = InboundGuard(limits, on_refused=lambda peer, reason: refused.append((peer, reason)))
    coordinator = coordinator_session(broker.fleet, broker.address(), guard=guard)
    heard: dict[str, list[Message]] = {"dev-a": [], "dev-b": []}
    devices = {
        name: device_session(
            broker.fleet, name, broker.address(name), on_message=lambda _t, m, n=name: heard[n].append(m)
        )
        for name in heard
    }

    def errors(device: str) -> list[Error]:
        return [m for m in heard[device] if isinstance(m, Error)]

    coordinator.start()
    try:
        for session, _ in devices.values():
            session.start()
        first, second = announce(4 << 20, CHUNK, kind="update"), announce(4 << 20, CHUNK, kind="update")
        devices["dev-a"][0].publish(devices["dev-a"][1].up, first)  # announced, never a chunk: held as pending
        assert until(lambda: coordinator.receiving() == [first.transfer]), "dev-a's transfer was never held"
        devices["dev-b"][0].publish(devices["dev-b"][1].up, second)
        assert until(lambda: errors("dev-b")), "dev-b was never answered"
        (refusal,) = errors("dev-b")
        assert refusal.code == "too_large" and "from all peers" in refusal.detail
        assert ("dev-b", "transfer_refused") in refused

        assert until(lambda: errors("dev-a")), "dev-a's transfer never expired"
        (expiry,) = errors("dev-a")
        assert expiry.transfer == first.transfer and "expired" in expiry.detail
        devices["dev-b"][0].publish(devices["dev-b"][1].up, second)  # room again: admitted this time
        assert until(lambda: coordinator.receiving() == [second.transfer]), "dev-b's transfer was not admitted"
        assert len(errors("dev-b")) == 1
    finally:
        for session, _ in devices.values():
            session.stop()
        coordinator.stop()
