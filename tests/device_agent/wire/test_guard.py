"""The inbound guard: per-peer rate, transfer bounds and retained messages, logged once per burst."""

from __future__ import annotations

import logging
import time

import pytest

from device_agent.agent.probe import probe_device
from device_agent.wire.budget import TokenBucket
from device_agent.wire.guard import InboundGuard, InboundLimits
from device_agent.wire.messages import Hello, Manifest, RoundFailed, Status
from device_agent.wire.session import coordinator_session, device_session
from device_agent.wire.topics import DeviceTopics
from tests.waiting import until


def manifest(size: int, chunk_size: int = 256 * 1024) -> Manifest:
    return Manifest(transfer="ab" * 16, kind="update", size=size, chunk_size=chunk_size)


def test_a_token_bucket_allows_its_burst_then_its_rate() -> None:
    bucket = TokenBucket(rate=10, capacity=3)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.05) is False  # half a token
    assert bucket.take(0.1) is True


def test_a_flood_is_cut_per_peer_and_logged_once_per_burst(caplog) -> None:
    refused: list[tuple[str, str]] = []
    guard = InboundGuard(InboundLimits(messages_per_s=10, burst=5, quiet_s=1.0), lambda p, r: refused.append((p, r)))
    a, b = DeviceTopics("f", "a").up, DeviceTopics("f", "b").up
    with caplog.at_level(logging.WARNING, logger="fedfleet.wire"):
        admitted = [guard.admit_frame(a, False, 0.0) == "a" for _ in range(1000)]
        assert guard.admit_frame(b, False, 0.0) == "b"  # another peer has its own bucket
    assert sum(admitted) == 5 and refused == [("a", "rate_limited")] * 995
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "from a (rate_limited)" in lines[0]
    with caplog.at_level(logging.WARNING, logger="fedfleet.wire"):
        guard.admit_frame(a, False, 0.5)  # still the same burst: not logged
        guard.refuse("a", "rate_limited", "again", 5.0)  # after a quiet second: a new burst
    assert len(caplog.records) == 2 and "994 more were refused" in caplog.records[-1].getMessage()


def test_only_hello_and_status_may_arrive_retained() -> None:
    guard = InboundGuard()
    hello = Hello(device="a", agent_version="1", profile=probe_device(0.01))
    assert guard.admit_message("a", hello, True, 0.0)
    assert guard.admit_message("a", Status(device="a", state="idle"), True, 0.0)
    assert not guard.admit_message("a", manifest(10), True, 0.0)
    assert not guard.admit_message("a", RoundFailed(run="r", round=1, reason="error"), True, 0.0)
    assert not guard.admit_message("a", None, True, 0.0)  # a chunk frame
    assert guard.admit_message("a", None, False, 0.0)


@pytest.mark.parametrize(
    ("size", "chunk_size", "problem"),
    [
        (10**9, 1, "chunks exceed the limit of 65536"),
        (10**8, 1024, "97657 chunks exceed the limit"),
        (50_000, 100, "below the 1024-byte minimum"),
        (3 << 30, 1 << 20, "exceed the 1073741824-byte transfer limit"),
    ],
)
def test_a_manifest_beyond_the_bounds_is_refused(size, chunk_size, problem) -> None:
    assert problem in InboundGuard().manifest_problem(manifest(size, chunk_size))


def test_small_payloads_in_one_chunk_and_normal_transfers_pass() -> None:
    guard = InboundGuard()
    assert guard.manifest_problem(manifest(10, 64)) is None  # one chunk: its size does not matter
    assert guard.manifest_problem(manifest(45 << 20)) is None  # a ResNet-18 update
    assert not guard.over(manifest(1 << 20), open_transfers=3, pending_bytes=1 << 20)
    assert guard.over(manifest(1 << 20), open_transfers=4, pending_bytes=0)
    assert guard.over(manifest(1 << 20), open_transfers=1, pending_bytes=1 << 30)


def test_a_guarded_receiver_admits_what_the_guard_admits_past_the_default_gigabyte() -> None:
    limits = InboundLimits(max_transfer_bytes=4 << 30, max_pending_bytes=4 << 30, max_open_transfers=2)
    big = manifest(2 << 30, chunk_size=1 << 20)
    assert InboundGuard(limits).manifest_problem(big) is None

    receiver = limits.receiver(nack_after=1.0)
    assert receiver.on_manifest(big, 0.0) == ([], None)  # open, waiting for chunks: no too_large
    assert receiver.max_pending_chunks == 2 * limits.max_chunks  # what the guard lets one peer hold open


def test_limits_and_reasons_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown refusal reason 'oops'"):
        InboundGuard().refuse("a", "oops", "x", 0.0)
    with pytest.raises(ValueError, match="max_open_transfers must be >= 1"):
        InboundLimits(max_open_transfers=0)
    with pytest.raises(ValueError, match="messages_per_s must be > 0"):
        InboundLimits(messages_per_s=0)


@pytest.mark.slow
def test_a_retained_manifest_is_refused_and_cleared_from_the_broker(fresh_mosquitto) -> None:
    """A device leaves a manifest retained; the coordinator refuses it on subscribing and clears it for good."""
    broker = fresh_mosquitto
    device, topics = device_session(broker.fleet, "dev-a", broker.address("dev-a"))
    device.start()
    device.publish(topics.up, manifest(10), retain=True)
    device.stop()
    for expected in ([("dev-a", "retained")], []):  # the second coordinator finds nothing left
        refused: list[tuple[str, str]] = []
        guard = InboundGuard(on_refused=lambda p, r, into=refused: into.append((p, r)))
        coordinator = coordinator_session(broker.fleet, broker.address(), guard=guard)
        coordinator.start()
        if expected:  # wait for the refusal (late on a loaded host) ...
            until(lambda seen=refused, want=expected: seen == want)
        else:  # ... and give a manifest still retained a second to show up
            time.sleep(1.0)
        coordinator.stop()
        assert refused == expected
