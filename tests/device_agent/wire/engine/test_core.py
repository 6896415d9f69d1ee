"""The engine's bookkeeping of one endpoint's transfers: who may answer them, refusals, cancellations, the window."""

from __future__ import annotations

import os

from device_agent.wire.engine import Outbound, OutgoingTransfer, Settled, TransferEngine
from device_agent.wire.engine.frames import is_chunk_frame
from device_agent.wire.engine.manifests import make_manifest
from device_agent.wire.messages import Ack, Error, Nack, parse_message

CHUNK = 1024
PEERS = {"dev/a/down": "a", "dev/b/down": "b"}


class Refusals:
    """An admission that only records refusals (what the engine asks of ``InboundGuard`` here)."""

    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []

    def refuse(self, peer: str, reason: str, detail: str, now: float) -> bool:
        self.refused.append((peer, reason))
        return False


def sending(payload: bytes, window_bytes: int = 1 << 20, admission=None) -> tuple[TransferEngine, OutgoingTransfer]:
    engine = TransferEngine("coordinator", 1.0, window_bytes, PEERS.get, admission)
    outgoing = OutgoingTransfer(make_manifest(payload, CHUNK), payload, 0.0, resend_after=2.0)
    engine.send("dev/a/down", outgoing)
    return engine, outgoing


def drain(engine: TransferEngine) -> list[Outbound]:
    frames = []
    while (frame := engine.next_frame()) is not None:
        frames.append(frame)
    return frames


def test_only_the_peer_a_transfer_goes_to_may_ack_it():
    refusals = Refusals()
    engine, outgoing = sending(os.urandom(3 * CHUNK), admission=refusals)
    drain(engine)
    ack = Ack(transfer=outgoing.transfer, digest=outgoing.manifest.digest)
    assert engine.receive("dev/b/down", ack, 1.0) == ()  # device b acking a's download
    assert refusals.refused == [("b", "wrong_sender")] and engine.busy()
    assert engine.receive("dev/a/down", ack, 1.0) == [Settled(outgoing.transfer)]
    assert not engine.busy()


def test_a_nack_draws_the_chunks_it_names_and_an_error_naming_the_transfer_settles_it_refused():
    engine, outgoing = sending(os.urandom(3 * CHUNK))
    drain(engine)
    resent = engine.receive("dev/a/down", Nack(transfer=outgoing.transfer, missing=[2]), 1.0)
    assert [(f.route, f.transfer, is_chunk_frame(f.data)) for f in resent] == [("dev/a/down", outgoing.transfer, True)]
    error = Error(code="too_large", transfer=outgoing.transfer, detail="over the limit")
    assert engine.receive("dev/a/down", error, 1.0) == [Settled(outgoing.transfer, "too_large: over the limit", True)]
    assert engine.receive("dev/a/down", Error(code="internal", detail="not about a transfer"), 1.0) == ()


def test_a_cancelled_transfer_settles_and_its_unsent_frames_are_never_built():
    engine, outgoing = sending(os.urandom(8 * CHUNK), window_bytes=2 * CHUNK)
    first = drain(engine)  # the manifest and two chunks fill the window
    assert len(first) == 3
    cancelled = engine.cancel(lambda manifest: manifest.round == 0, "superseded")
    assert cancelled == [Settled(outgoing.transfer, "cancelled: superseded")]
    assert engine.settle(sum(len(f.data) for f in first)) is True  # the backlog still holds it...
    assert engine.next_frame() is None and not engine.window  # ...until the window drops it unbuilt


def test_a_transfer_waiting_for_the_window_is_not_re_announced_however_long_it_waits():
    payload = os.urandom(2 * CHUNK)
    manifest = make_manifest(payload, CHUNK)
    first_bytes = sum(len(frame) for frame in OutgoingTransfer(manifest, payload, 0.0).start())
    engine = TransferEngine("coordinator", 1.0, first_bytes + 1)
    first = OutgoingTransfer(manifest, payload, 0.0, resend_after=2.0)
    second = OutgoingTransfer(make_manifest(payload, CHUNK), payload, 0.0, resend_after=2.0)
    engine.send("dev/a/down", first)
    engine.send("dev/b/down", second)
    sent = drain(engine)  # all of the first transfer, then the second's manifest: the window is full
    assert [f.transfer for f in sent] == [first.transfer] * 3 + [second.transfer]
    announced = [parse_message(f.data).transfer for t in range(1, 30) for f in engine.tick(float(t))]
    assert second.transfer not in announced  # its chunks wait for us, not for its receiver
    assert first.transfer in announced  # the first waits for an answer: re-announced after silence


def test_after_a_reconnect_senders_re_announce_and_receivers_nack_what_they_lack():
    payload = os.urandom(3 * CHUNK)
    sender, outgoing = sending(payload)
    receiver = TransferEngine("device", 1.0, 1 << 20)
    manifest, chunk0, *_lost = drain(sender)
    for frame in (manifest, chunk0):
        receiver.receive("dev/a/up", frame.data if is_chunk_frame(frame.data) else parse_message(frame.data), 0.5)
    [announce] = sender.resume(5.0)
    [nack] = receiver.resume(5.0)
    assert parse_message(announce.data).transfer == outgoing.transfer
    assert nack.route == "dev/a/up" and parse_message(nack.data).missing == [1, 2]


def test_a_carrier_with_a_connection_per_peer_resumes_only_the_peer_that_reconnected():
    payload = os.urandom(3 * CHUNK)
    engine, to_a = sending(payload)
    to_b = OutgoingTransfer(make_manifest(payload, CHUNK), payload, 0.0, resend_after=2.0)
    engine.send("dev/b/down", to_b)
    drain(engine)
    [announce] = engine.resume(5.0, "dev/b/down")
    assert (announce.route, parse_message(announce.data).transfer) == ("dev/b/down", to_b.transfer)
    announced = [parse_message(f.data).transfer for f in engine.tick(5.5)]
    assert announced == [to_a.transfer]  # a's silence still counts from its send: b's reconnect did not reset it
