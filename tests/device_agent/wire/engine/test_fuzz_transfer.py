"""Property: any sequence of manifests, chunk frames and answers leaves both transfer sides consistent.

The receiver only raises for nothing: bad frames are ProtocolError at parse time, everything else
is dropped, nacked or answered with an Error; its bookkeeping stays within its declared bounds.
"""

import hashlib
import json
import tracemalloc

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_agent.wire.engine.frames import HEADER_SIZE, chunk_frame, parse_chunk_frame
from device_agent.wire.engine.incoming import IncomingTransfers
from device_agent.wire.engine.manifests import make_manifest
from device_agent.wire.engine.outgoing import OutgoingTransfer
from device_agent.wire.messages import Ack, Error, Manifest, Nack, ProtocolError, parse_message

FUZZ = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
IDS = ["0" * 32, "1" * 32]

manifests = st.fixed_dictionaries(
    {
        "v": st.just(3),
        "type": st.just("manifest"),
        "transfer": st.sampled_from(IDS),
        "size": st.integers(0, 64) | st.sampled_from([2**30, 2**31, 2**62]),
        "chunk_size": st.integers(1, 16) | st.sampled_from([2**20, 2**40]),
    },
    optional={"chunks": st.lists(st.sampled_from(["a" * 64, hashlib.sha256(b"").hexdigest()]), max_size=5)},
)
chunks = st.tuples(st.sampled_from(IDS), st.integers(0, 2**32 - 1) | st.integers(0, 8), st.binary(max_size=16))
events = st.lists(st.one_of(manifests, chunks, st.binary(max_size=80)), max_size=12)


def _feed(receiver: IncomingTransfers, event, now: float) -> None:
    if isinstance(event, dict):
        if "chunks" in event:
            event = {**event, "digest": hashlib.sha256(b"".join(bytes.fromhex(d) for d in event["chunks"])).hexdigest()}
        try:
            manifest = parse_message(json.dumps(event).encode())
        except ProtocolError:
            return
        replies, _ = receiver.on_manifest(manifest, now)
    else:
        frame = chunk_frame(event[0], event[1], event[2]) if isinstance(event, tuple) else event
        try:
            parsed = parse_chunk_frame(frame)
        except ProtocolError:
            return
        replies, _ = receiver.on_chunk(*parsed, now)
    assert all(isinstance(reply, Ack | Nack | Error) for reply in replies)


@FUZZ
@given(events)
@example([{"v": 3, "type": "manifest", "transfer": IDS[0], "size": 2**30, "chunk_size": 1}])
@example([{"v": 3, "type": "manifest", "transfer": IDS[i], "size": 2**16, "chunk_size": 1} for i in (0, 1)])
def test_receiver_takes_any_event_sequence_within_its_bounds(sequence):
    receiver = IncomingTransfers(max_pending_bytes=2**31)
    tracemalloc.start()
    try:
        for step, event in enumerate(sequence):
            _feed(receiver, event, float(step))
        receiver.poll(1000.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"bookkeeping peaked at {peak} bytes"


def test_a_manifest_of_too_many_chunks_is_refused_before_any_bookkeeping():
    receiver = IncomingTransfers()
    manifest = Manifest(transfer=IDS[0], size=2**30, chunk_size=1)
    replies, completed = receiver.on_manifest(manifest, 0.0)
    assert completed is None and receiver.pending() == []
    assert isinstance(replies[0], Error) and replies[0].code == "too_large"
    assert "send bigger chunks" in replies[0].detail


@FUZZ
@given(st.binary(min_size=0, max_size=HEADER_SIZE + 8))
@example(b"FFCK")
@example(b"FFCK\x02")
@example(b"FFCK\x09" + b"\x00" * 60)
def test_chunk_frames_parse_or_raise_protocol_error(frame):
    try:
        transfer, index, data, digest = parse_chunk_frame(b"FFCK" + frame[4:] if frame[:1] == b"F" else frame)
    except ProtocolError as exc:
        assert str(exc)
    else:
        assert len(transfer) == 32 and index >= 0 and len(digest) == 32 and len(data) >= 0


@FUZZ
@given(st.lists(st.integers(0, 2**40) | st.integers(0, 6), max_size=50), st.sampled_from(["a" * 64, None]))
def test_sender_answers_any_nack_or_ack_with_frames_of_its_own_chunks(missing, acked):
    payload = bytes(range(20))
    sender = OutgoingTransfer(make_manifest(payload, chunk_size=4), payload, now=0.0, resend_after=0.0)
    frames = sender.on_nack(Nack(transfer=sender.transfer, missing=missing), now=1.0)
    assert len(frames) == len({i for i in missing if i < 5}) or (not missing and len(frames) == 1)
    if acked is not None:
        assert not sender.on_ack(Ack(transfer=sender.transfer, digest=acked))
        assert sender.failed
