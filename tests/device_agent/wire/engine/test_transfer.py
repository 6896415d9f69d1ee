"""The two sides of one transfer (``engine.outgoing``, ``engine.incoming``) over a simulated lossy link, driven by
a fake clock."""

import hashlib
import os
import random

import pytest

from device_agent.wire.engine.frames import chunk_frame, is_chunk_frame, parse_chunk_frame
from device_agent.wire.engine.incoming import IncomingTransfers
from device_agent.wire.engine.manifests import Limits, PayloadTooLarge, announce, make_manifest
from device_agent.wire.engine.outgoing import OutgoingTransfer
from device_agent.wire.messages import Ack, Nack, ProtocolError, encode, parse_message

CHUNK = 1024


def deliver(frames, receiver, sender, now, completed):
    """Hand frames to the receiver and its answers back to the sender; returns frames the sender resends."""
    resend = []
    for frame in frames:
        if is_chunk_frame(frame):
            replies, done = receiver.on_chunk(*parse_chunk_frame(frame), now)
        else:
            replies, done = receiver.on_manifest(parse_message(frame), now)
        if done is not None:
            completed.append(done)
        for reply in replies:
            if isinstance(reply, Nack):
                resend += sender.on_nack(reply, now)
            elif isinstance(reply, Ack):
                sender.on_ack(reply)
    return resend


def run_link(payload, mangle, seed=0, max_steps=200, sealed=True):
    """Send ``payload`` through ``mangle`` (a function of the frame list) until acked; returns what arrived.

    ``sealed``: announce a manifest hashed beforehand, or hash while sending and seal at the end.
    """
    rng = random.Random(seed)
    manifest = make_manifest(payload, CHUNK) if sealed else announce(len(payload), CHUNK)
    now = 0.0
    sender = OutgoingTransfer(manifest, payload, now, resend_after=5.0)
    receiver = IncomingTransfers(nack_after=1.0)
    completed = []
    frames = sender.start()
    for _ in range(max_steps):
        frames = deliver(mangle(frames, rng), receiver, sender, now, completed)
        if sender.done:
            break
        now += 0.5
        frames += sender.poll(now)
        for reply in receiver.poll(now):
            frames += sender.on_nack(reply, now)
    return sender, receiver, completed


def lose(frames, rng):
    return [f for f in frames if rng.random() > 0.3]


def duplicate(frames, rng):
    return [g for f in frames for g in ([f, f] if rng.random() < 0.5 else [f])]


def reorder(frames, rng):
    frames = list(frames)
    rng.shuffle(frames)
    return frames


def corrupt(frames, rng):
    out = []
    for frame in frames:
        if is_chunk_frame(frame) and rng.random() < 0.3:
            broken = bytearray(frame)
            broken[-1] ^= 0xFF
            frame = bytes(broken)
        out.append(frame)
    return out


def everything(frames, rng):
    return corrupt(reorder(duplicate(lose(frames, rng), rng), rng), rng)


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "hashed-while-sending"])
@pytest.mark.parametrize("mangle", [lose, duplicate, reorder, corrupt, everything])
@pytest.mark.parametrize("size", [0, 1, CHUNK, 20 * CHUNK + 7])
def test_a_transfer_completes_bit_exact_exactly_once_whatever_the_link_does(mangle, size, sealed):
    payload = os.urandom(size)
    sender, receiver, completed = run_link(payload, mangle, sealed=sealed)
    assert sender.done and not sender.failed
    assert len(completed) == 1
    assert completed[0].data == payload
    assert completed[0].manifest.digest == make_manifest(payload, CHUNK).digest
    assert receiver.pending() == []


def test_the_receiver_counts_what_it_repaired_and_ignores_late_chunks():
    payload = os.urandom(10 * CHUNK)
    _sender, receiver, _ = run_link(payload, everything, seed=3)
    stats = receiver.stats
    assert stats.completed == 1
    assert stats.duplicates + stats.corrupt + stats.orphans > 0
    assert stats.nacks > 0


def test_a_finished_transfer_is_re_acked_and_never_delivered_twice():
    payload = os.urandom(3 * CHUNK)
    manifest = make_manifest(payload, CHUNK)
    sender = OutgoingTransfer(manifest, payload, 0.0)
    receiver = IncomingTransfers()
    completed = []
    deliver(sender.start(), receiver, sender, 0.0, completed)
    replies, again = receiver.on_manifest(manifest, 1.0)
    assert again is None and replies == [
        Ack(transfer=manifest.transfer, digest=manifest.digest, sent_at=replies[0].sent_at)
    ]
    replies, late = receiver.on_chunk(*parse_chunk_frame(sender.frame(0)), 1.0)
    assert (replies, late) == ([], None) and receiver.stats.late == 1
    assert len(completed) == 1


def test_a_silent_receiver_gets_the_manifest_again_less_often_then_the_sender_gives_up():
    payload = os.urandom(2 * CHUNK)
    sender = OutgoingTransfer(make_manifest(payload, CHUNK), payload, 0.0, resend_after=1.0, max_attempts=3)
    sender.start()
    times = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0)  # silences of 1, 2, 4 s between re-announcements
    announcements = [sender.poll(t) for t in times]
    assert [len(a) for a in announcements] == [0, 1, 0, 1, 0, 0, 1]
    assert not sender.failed
    assert sender.poll(15.0) == [] and sender.failed and "3 re-announcements" in sender.failed


def test_an_answer_resets_the_back_off():
    payload = os.urandom(2 * CHUNK)
    sender = OutgoingTransfer(make_manifest(payload, CHUNK), payload, 0.0, resend_after=1.0, max_attempts=5)
    sender.start()
    assert [len(sender.poll(t)) for t in (1.0, 3.0)] == [1, 1]  # silences of 1 then 2 s
    sender.on_nack(Nack(transfer=sender.transfer, missing=[]), 3.5)
    assert len(sender.poll(4.5)) == 1  # 1 s again after an answer


def test_a_receiver_refuses_a_manifest_beyond_its_limit():
    payload = os.urandom(4 * CHUNK)
    replies, _ = IncomingTransfers(max_payload_bytes=CHUNK).on_manifest(make_manifest(payload, CHUNK), 0.0)
    assert replies[0].code == "too_large"


def test_oversize_payloads_and_chunks_are_refused_before_anything_is_built():
    with pytest.raises(PayloadTooLarge, match="exceeds the 100-byte transfer limit"):
        make_manifest(os.urandom(101), 10, limits=Limits(max_payload_bytes=100))
    with pytest.raises(PayloadTooLarge, match="maximum packet size"):
        make_manifest(os.urandom(10), 4096, limits=Limits(max_packet_bytes=4096))


def test_chunk_frames_are_a_small_header_and_the_raw_bytes():
    frame = chunk_frame("ab" * 16, 7, b"xyz")
    assert len(frame) == 57 + 3
    assert parse_chunk_frame(frame) == ("ab" * 16, 7, b"xyz", hashlib.sha256(b"xyz").digest())
    with pytest.raises(ProtocolError, match="unsupported chunk frame version 9"):
        parse_chunk_frame(frame[:4] + b"\x09" + frame[5:])
    with pytest.raises(ProtocolError, match="shorter than"):
        parse_chunk_frame(frame[:10])


def test_a_chunk_forged_with_a_matching_frame_digest_is_caught_by_the_seal_and_fetched_again():
    payload = os.urandom(4 * CHUNK)
    sender = OutgoingTransfer(announce(len(payload), CHUNK), payload, 0.0)
    receiver = IncomingTransfers()
    frames = list(sender.start())
    forged = os.urandom(CHUNK)
    frames[2] = chunk_frame(sender.transfer, 1, forged)  # chunk 1, self-consistent but not the sender's bytes
    for frame in frames[:-1]:  # everything but the seal
        if is_chunk_frame(frame):
            assert receiver.on_chunk(*parse_chunk_frame(frame), 0.0) == ([], None)
        else:
            receiver.on_manifest(parse_message(frame), 0.0)
    replies, done = receiver.on_manifest(parse_message(frames[-1]), 0.0)
    assert done is None and replies[0].missing == [1] and receiver.stats.corrupt == 1
    [resent] = sender.on_nack(replies[0], 0.0)
    _, done = receiver.on_chunk(*parse_chunk_frame(resent), 0.1)
    assert done is not None and done.data == payload


def test_a_receiver_with_every_chunk_but_no_seal_asks_for_it_with_an_empty_nack():
    payload = os.urandom(3 * CHUNK)
    sender = OutgoingTransfer(announce(len(payload), CHUNK), payload, 0.0)
    receiver = IncomingTransfers(nack_after=1.0)
    *frames, _lost_seal = list(sender.start())
    for frame in frames:
        if is_chunk_frame(frame):
            receiver.on_chunk(*parse_chunk_frame(frame), 0.0)
        else:
            receiver.on_manifest(parse_message(frame), 0.0)
    [nack] = receiver.poll(2.0)
    assert nack.missing == []
    [seal] = sender.on_nack(nack, 2.0)
    replies, done = receiver.on_manifest(parse_message(seal), 2.0)
    assert done.data == payload and replies[0].digest == sender.manifest.digest


def test_a_manifest_of_65536_chunks_repeated_draws_bounded_nacks_not_amplification():
    """An attacker announces the most chunks the guard admits and repeats the manifest for a minute."""
    manifest = announce(65_536 * CHUNK, CHUNK)
    receiver = IncomingTransfers(nack_after=2.0, max_pending_chunks=1 << 17, abandon_after=600.0)
    sent = answered = 0
    for tick in range(600):  # every 0.1 s for 60 s: a repeated manifest, and the receiver's timer
        now = tick * 0.1
        sent += len(encode(manifest))
        replies, _ = receiver.on_manifest(manifest, now)
        replies += receiver.poll(now)
        answered += sum(len(encode(reply)) for reply in replies)
    assert answered < sent  # was ~29,000x: every answer listed all 65,536 chunks
    nack = receiver.resume(manifest.transfer, 60.0)
    assert nack.missing == list(range(64)) and len(encode(nack)) < 600


def test_a_large_loss_is_repaired_batch_by_batch_without_waiting_for_the_timer():
    payload = os.urandom(300 * CHUNK)
    sender = OutgoingTransfer(make_manifest(payload, CHUNK), payload, 0.0)
    receiver = IncomingTransfers(nack_after=1.0, max_nack_chunks=64)
    frames = list(sender.start())
    replies, _ = receiver.on_manifest(parse_message(frames[0]), 0.0)  # every chunk after it is lost
    assert replies == []
    [nack] = receiver.poll(1.0)
    completed: list = []
    resend = sender.on_nack(nack, 1.0)
    while resend:  # each batch, once in, asks for the next at once: no poll in between
        resend = deliver(resend, receiver, sender, 1.0, completed)
    assert sender.done and completed[0].data == payload
    assert receiver.stats.nacks == 5  # 300 chunks in batches of 64


def test_dropping_the_transfers_of_closed_rounds_frees_their_pending_bytes():
    receiver = IncomingTransfers()
    payload = os.urandom(3 * CHUNK)
    old, new = (make_manifest(payload, CHUNK, round=r) for r in (1, 2))
    for manifest in (old, new):
        receiver.on_manifest(manifest, 0.0)
    assert receiver.pending_bytes() == 6 * CHUNK
    assert receiver.drop_where(lambda manifest: manifest.round <= 1) == [old.transfer]
    assert receiver.pending() == [new.transfer] and receiver.pending_bytes() == 3 * CHUNK
    frame = OutgoingTransfer(old, payload, 0.0).frame(0)
    replies, completed = receiver.on_chunk(*parse_chunk_frame(frame), 1.0)
    assert (replies, completed) == ([], None) and receiver.stats.orphans == 1
