"""Properties of the sans-IO transfer engine between two endpoints, with no broker: a simulated network that
loses, repeats, reorders and corrupts frames and drops the connection at random points.

Whatever it does, once the network turns fair the receiver hands over exactly the bytes sent, exactly once, the
sender's transfer settles delivered, and the sender's window never held more than its bound plus one frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_agent.wire.engine import Arrived, Outbound, OutgoingTransfer, Outputs, Settled, TransferEngine
from device_agent.wire.engine.frames import HEADER_SIZE, is_chunk_frame, parse_chunk_frame
from device_agent.wire.engine.manifests import announce, make_manifest
from device_agent.wire.messages import Nack, parse_message

PROPERTIES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TO_RECEIVER, TO_SENDER = "to-receiver", "to-sender"
"""Routes: where each endpoint answers the other (an MQTT carrier would use the peer's reply topic)."""
RESEND_AFTER, NACK_AFTER = 2.0, 1.0


@dataclass
class Wire:
    """Frames in flight one way; a frame taken off it (delivered or lost) is confirmed to the sender's window."""

    frames: list[tuple[bytes, bool]] = field(default_factory=list)
    """(frame, counted in the sender's window)"""


@dataclass
class Net:
    """A sender and a receiver engine and the two wires between them, driven by a fake clock."""

    sender: TransferEngine
    receiver: TransferEngine
    window_bytes: int
    now: float = 0.0
    down: Wire = field(default_factory=Wire)
    up: Wire = field(default_factory=Wire)
    arrived: list[bytes] = field(default_factory=list)
    settled: list[Settled] = field(default_factory=list)
    resent: int = 0

    def apply(self, outputs: Outputs, wire: Wire) -> None:
        for out in outputs:
            if isinstance(out, Outbound):
                assert out.route == (TO_RECEIVER if wire is self.down else TO_SENDER)
                wire.frames.append((out.data, False))
                self.resent += wire is self.down and is_chunk_frame(out.data)
            elif isinstance(out, Arrived):
                self.arrived.append(out.completed.data)
            else:
                self.settled.append(out)

    def pump(self) -> None:
        """The sender's carrier takes first-attempt frames while its window has room."""
        while (out := self.sender.next_frame()) is not None:
            assert self.sender.window.in_window - len(out.data) < self.window_bytes, "frame taken past the window"
            self.down.frames.append((out.data, True))

    def take(self, wire: Wire, index: int) -> bytes:
        data, windowed = wire.frames.pop(index % len(wire.frames))
        if windowed:
            self.sender.settle(len(data))
        return data

    def deliver(self, wire: Wire, index: int = 0) -> None:
        data = self.take(wire, index)
        frame = data if is_chunk_frame(data) else parse_message(data)
        if wire is self.down:
            self.apply(self.receiver.receive(TO_SENDER, frame, self.now), self.up)
        else:
            self.apply(self.sender.receive(TO_RECEIVER, frame, self.now), self.down)

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.apply(self.sender.tick(self.now), self.down)
        self.apply(self.receiver.tick(self.now), self.up)

    def reconnect(self) -> None:
        """The connection drops with frames in flight both ways; after it is back both sides resume."""
        for wire in (self.down, self.up):
            while wire.frames:
                self.take(wire, 0)
        self.now += 1.0
        self.apply(self.sender.resume(self.now), self.down)
        self.apply(self.receiver.resume(self.now), self.up)

    def settle_fairly(self, rounds: int = 400) -> None:
        """The network turns fair: every frame arrives, in order, until the transfer is done both ways."""
        for _ in range(rounds):
            self.pump()
            while self.down.frames or self.up.frames:
                for wire in (self.down, self.up):
                    if wire.frames:
                        self.deliver(wire)
                self.pump()
            if self.settled and not self.receiver.busy():
                return
            self.tick(1.0)


def start(payload: bytes, chunk_size: int, sealed: bool, window_chunks: int) -> Net:
    window_bytes = window_chunks * (chunk_size + HEADER_SIZE)
    sender = TransferEngine("sender", NACK_AFTER, window_bytes)
    receiver = TransferEngine("receiver", NACK_AFTER, window_bytes)
    manifest = make_manifest(payload, chunk_size) if sealed else announce(len(payload), chunk_size)
    sender.send(TO_RECEIVER, OutgoingTransfer(manifest, payload, 0.0, resend_after=RESEND_AFTER, max_attempts=50))
    return Net(sender, receiver, window_bytes)


def corrupt(net: Net, index: int) -> None:
    """Flip the last byte of a chunk frame on its way to the receiver (its digest no longer holds)."""
    chunks = [i for i, (data, _w) in enumerate(net.down.frames) if is_chunk_frame(data) and len(data) > HEADER_SIZE]
    if chunks:
        at = chunks[index % len(chunks)]
        data, windowed = net.down.frames[at]
        net.down.frames[at] = (data[:-1] + bytes([data[-1] ^ 0xFF]), windowed)


ACTIONS = st.sampled_from(["deliver", "deliver_up", "lose", "duplicate", "corrupt", "tick", "reconnect", "pump"])


@PROPERTIES
@given(
    payload=st.binary(max_size=600),
    chunk_size=st.integers(1, 97),
    sealed=st.booleans(),
    window_chunks=st.integers(1, 6),
    steps=st.lists(st.tuples(ACTIONS, st.integers(0, 2**16)), max_size=80),
)
def test_whatever_the_network_does_the_receiver_gets_the_bytes_exactly_once_and_the_sender_settles(
    payload, chunk_size, sealed, window_chunks, steps
):
    net = start(payload, chunk_size, sealed, window_chunks)
    for action, n in steps:
        wire = net.up if action == "deliver_up" else net.down
        if action in ("deliver", "deliver_up", "lose", "duplicate") and not wire.frames:
            continue
        if action in ("deliver", "deliver_up"):
            net.deliver(wire, n)  # any frame in flight, not the oldest: reordering
        elif action == "lose":
            net.take(wire, n)
        elif action == "duplicate":
            wire.frames.insert(n % (len(wire.frames) + 1), (wire.frames[n % len(wire.frames)][0], False))
        elif action == "corrupt":
            corrupt(net, n)
        elif action == "tick":
            net.tick(n % 5 * 0.5)
        elif action == "reconnect":
            net.reconnect()
        else:
            net.pump()
    net.settle_fairly()
    assert net.arrived == [payload]
    assert [(s.error, s.refused) for s in net.settled] == [(None, False)]
    assert not net.sender.busy() and not net.receiver.busy()
    assert net.sender.window.in_window == 0 and not net.sender.window


@PROPERTIES
@given(
    payload=st.binary(min_size=1, max_size=400),
    chunk_size=st.integers(1, 40),
    lost=st.sets(st.integers(0, 399), min_size=1),
)
def test_a_nack_asks_for_exactly_the_lost_chunks_and_the_sender_resends_them(payload, chunk_size, lost):
    net = start(payload, chunk_size, sealed=True, window_chunks=10**6)
    net.pump()
    count = -(-len(payload) // chunk_size)
    lost = {i % count for i in lost}
    for data, _w in list(net.down.frames):
        if is_chunk_frame(data) and parse_chunk_frame(data)[1] in lost:
            net.down.frames.remove((data, True))
            net.sender.settle(len(data))
    while net.down.frames:
        net.deliver(net.down)
    assert net.arrived == []
    net.tick(NACK_AFTER)  # nothing arrived for nack_after: the receiver asks
    [nack] = [parse_message(data) for data, _w in net.up.frames]
    assert isinstance(nack, Nack) and set(nack.missing) == set(sorted(lost)[:64])
    net.deliver(net.up)
    resent = {parse_chunk_frame(data)[1] for data, _w in net.down.frames}
    assert resent == set(nack.missing)
    net.settle_fairly()
    assert net.arrived == [payload] and [s.error for s in net.settled] == [None]


@PROPERTIES
@given(payload=st.binary(min_size=1, max_size=300), chunk_size=st.integers(1, 50), which=st.integers(0, 2**16))
def test_a_corrupted_chunk_is_refused_and_fetched_again(payload, chunk_size, which):
    net = start(payload, chunk_size, sealed=True, window_chunks=10**6)
    net.pump()
    corrupt(net, which)
    while net.down.frames:
        net.deliver(net.down)
    [stats] = [transfers.stats for transfers in net.receiver.receivers.peers.values()]
    assert stats.corrupt == 1 and net.arrived == []
    net.settle_fairly()
    assert net.arrived == [payload] and stats.completed == 1 and net.resent >= 1
