"""The transfer engine of one endpoint: frames in, frames and events out, nothing else.

No sockets, threads, topics or broker: a carrier (``device_agent.wire.session`` over MQTT) reads frames, hands
them in with the time, and sends what comes back; a test hands them in with a fake clock and loses, repeats and
reorders them at will. Routes are the carrier's opaque names for where to answer a peer (an MQTT reply topic).

The window and the transfers keep apart state, so a carrier may guard them with separate locks: building a frame
(which may wait for a pool hashing its chunk) then never holds up filing a chunk. Only :meth:`send` touches both;
such a carrier calls its two halves instead (``senders.add`` under the one lock, ``window.enqueue`` under the
other) and passes :meth:`tick` the window's ``waiting()``, never taking one lock while it holds the other.
"""

from __future__ import annotations

from collections.abc import Callable

from device_agent.wire.engine.admission import Admission, PeerOf
from device_agent.wire.engine.events import NOTHING, Outbound, Output, Outputs
from device_agent.wire.engine.frames import chunk_is_intact, is_chunk_frame, parse_chunk_frame
from device_agent.wire.engine.outgoing import Hasher, OutgoingTransfer
from device_agent.wire.engine.receivers import Receivers
from device_agent.wire.engine.senders import Senders
from device_agent.wire.engine.window import Window
from device_agent.wire.messages import Ack, Error, Manifest, Message, Nack


def no_peers(_route: str) -> str | None:
    """Routes that name no peer: any route may answer any transfer."""
    return None


class TransferEngine:
    """Verified, resumable chunked transfers to and from many peers, as one state machine.

    ``nack_after``: seconds without progress before a receiver asks for what it lacks; ``window_bytes``: most
    bytes of first-attempt frames out and not yet settled. ``peer_of`` and ``admission``: see
    :class:`~device_agent.wire.engine.senders.Senders` and :class:`~device_agent.wire.engine.receivers.Receivers`.
    """

    def __init__(
        self,
        name: str,
        nack_after: float,
        window_bytes: int,
        peer_of: PeerOf = no_peers,
        admission: Admission | None = None,
    ) -> None:
        self.senders = Senders(name, peer_of, admission)
        self.receivers = Receivers(nack_after, peer_of, admission)
        self.window = Window(window_bytes)

    def busy(self) -> bool:
        """Whether a transfer is on its way either way (a carrier's timer may sleep while none is)."""
        return bool(self.senders) or bool(self.receivers)

    # ---- sending ---------------------------------------------------------------------------------------------

    def send(self, route: str, outgoing: OutgoingTransfer, hasher: Hasher | None = None) -> None:
        """Start ``outgoing`` to ``route``: its frames leave through :meth:`next_frame` as the window has room."""
        self.senders.add(route, outgoing)
        self.window.enqueue(route, outgoing.transfer, outgoing.start(hasher))

    def next_frame(self) -> Outbound | None:
        """The next first-attempt frame the window has room for, or None."""
        return self.window.next(self.senders.__contains__)

    def settle(self, size: int) -> bool:
        """``size`` bytes of window frames were confirmed (or lost); whether more wait for :meth:`next_frame`."""
        return self.window.settle(size)

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> Outputs:
        """Stop sending every transfer whose manifest is ``stale``; each settles failed with ``why``."""
        return self.senders.cancel(stale, why)

    # ---- frames in -------------------------------------------------------------------------------------------

    def receive(self, route: str, frame: bytes | memoryview | Message, now: float) -> Outputs:
        """One frame from the peer answered on ``route``: a chunk frame (hashed here) or a parsed manifest, ack,
        nack or error. Other messages are no transfer's: nothing. A malformed chunk frame raises ``ProtocolError``.
        """
        if isinstance(frame, bytes | memoryview):
            if not is_chunk_frame(frame):
                raise ValueError("a chunk frame or a parsed message, not other bytes")
            transfer, index, data, digest = parse_chunk_frame(frame)
            return self.on_chunk(route, transfer, index, data, digest, now)
        if isinstance(frame, Manifest):
            return self.on_manifest(route, frame, now)
        if isinstance(frame, Ack | Nack):
            return self.on_answer(route, frame, now)
        if isinstance(frame, Error):
            return self.on_error(frame)
        return NOTHING

    def on_chunk(
        self,
        route: str,
        transfer: str,
        index: int,
        data: bytes | memoryview,
        digest: bytes,
        now: float,
        intact: bool | None = None,
    ) -> Outputs:
        """One parsed chunk; ``intact``: whether ``data`` hashes to ``digest``, if the caller hashed it already."""
        if intact is None:
            intact = chunk_is_intact(data, digest)
        return self.receivers.on_chunk(route, transfer, index, data, digest, now, intact)

    def on_manifest(self, route: str, manifest: Manifest, now: float) -> Outputs:
        return self.receivers.on_manifest(route, manifest, now)

    def on_answer(self, route: str, answer: Ack | Nack, now: float) -> Outputs:
        return self.senders.answer(answer, now, route)

    def on_error(self, error: Error) -> Outputs:
        """A receiver refused one of our transfers (an error naming it); other errors are no transfer's."""
        if error.transfer is None:
            return NOTHING
        return self.senders.fail(error.transfer, f"{error.code}: {error.detail}")

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Refuse every new inbound transfer whose manifest is ``stale`` (see ``Receivers.refuse``)."""
        return self.receivers.refuse(stale, why)

    # ---- time and reconnects ---------------------------------------------------------------------------------

    def tick(self, now: float, waiting: set[str] | None = None) -> list[Output]:
        """Called every so often while :meth:`busy`: re-announcements, nacks, expiries and give-ups due.

        ``waiting``: the window's ``waiting()``, when the caller read it under the window's own lock.
        """
        waiting = self.window.waiting() if waiting is None else waiting
        return self.senders.poll(now, waiting) + self.receivers.poll(now)

    def resume(self, now: float, route: str | None = None) -> list[Outbound]:
        """After the carrier reconnected: every unfinished transfer re-announced, every incomplete one nacked.

        ``route``: only one peer's (a carrier with a connection per peer), the others' state untouched."""
        return self.senders.resume(now, route) + self.receivers.resume(now, route)
