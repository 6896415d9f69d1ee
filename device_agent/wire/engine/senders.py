"""Every outgoing transfer of one endpoint: its receivers' answers, re-announcements, resumes, cancellations.

Pure bookkeeping: each call returns the frames to send and the transfers that settled; sending them, and
telling whoever waits for a delivery, is the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from device_agent.wire.engine.admission import Admission, PeerOf
from device_agent.wire.engine.events import NOTHING, Outbound, Output, Outputs, Settled
from device_agent.wire.engine.outgoing import OutgoingTransfer
from device_agent.wire.messages import Ack, Manifest, Nack

log = logging.getLogger("fedfleet.wire")


class Senders:
    """Outgoing transfers by id, each with the route it goes to.

    ``peer_of(route)`` names the peer behind a route: only the peer a transfer goes to may ack or nack it
    (another one is refused through ``admission``, when there is one).
    """

    def __init__(self, name: str, peer_of: PeerOf, admission: Admission | None = None) -> None:
        self._name = name
        self._peer_of = peer_of
        self._admission = admission
        self._outgoing: dict[str, tuple[str, OutgoingTransfer]] = {}

    def __bool__(self) -> bool:
        return bool(self._outgoing)

    def __contains__(self, transfer: object) -> bool:
        return transfer in self._outgoing

    def add(self, route: str, outgoing: OutgoingTransfer) -> None:
        self._outgoing[outgoing.transfer] = (route, outgoing)

    def touch(self, transfer: str, now: float) -> None:
        """Evidence ``transfer`` is progressing (the carrier took one of its frames): postpones re-announcing.

        Safe without the caller's lock: a lone lookup and float update, atomic under the GIL.
        """
        entry = self._outgoing.get(transfer)
        if entry is not None:
            entry[1].touch(now)

    def answer(self, message: Ack | Nack, now: float, source: str) -> Outputs:
        """Take a receiver's ack or nack arriving from the peer on route ``source``: the frames a nack asks for
        again, or the transfer settled by an ack."""
        entry = self._outgoing.get(message.transfer)
        if entry is None:
            return NOTHING  # an answer to a transfer already settled: a duplicate ack
        route, outgoing = entry
        if self._peer_of(route) != self._peer_of(source):
            if self._admission is not None:  # only the transfer's receiver may ack or nack it
                peer = self._peer_of(source) or source
                detail = f"a {message.type} for a transfer to {self._peer_of(route)}"
                self._admission.refuse(peer, "wrong_sender", detail, now)
            return NOTHING
        if isinstance(message, Nack):
            return [Outbound(route, frame, outgoing.transfer) for frame in outgoing.on_nack(message, now)]
        outgoing.on_ack(message)
        del self._outgoing[message.transfer]
        return [Settled(outgoing.transfer, outgoing.failed)]

    def fail(self, transfer: str, error: str) -> Outputs:
        """The receiver refused ``transfer``."""
        if self._outgoing.pop(transfer, None) is None:
            return NOTHING
        return [Settled(transfer, error, refused=True)]

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> list[Settled]:
        """Stop every transfer whose manifest is ``stale``: no more chunks, re-announcements or repairs."""
        cancelled = [tid for tid, (_route, outgoing) in self._outgoing.items() if stale(outgoing.manifest)]
        for tid in cancelled:
            del self._outgoing[tid]
        return [Settled(tid, f"cancelled: {why}") for tid in cancelled]

    def resume(self, now: float, to: str | None = None) -> list[Outbound]:
        """After a reconnect: every unfinished transfer (to route ``to`` only, if given: one peer's connection)
        re-announced (its receiver nacks what it lacks)."""
        return [
            Outbound(route, frame, outgoing.transfer)
            for route, outgoing in self._outgoing.values()
            if to is None or route == to
            for frame in outgoing.resume(now)
        ]

    def poll(self, now: float, waiting: set[str]) -> list[Output]:
        """Re-announcements due; transfers that gave up settle as failed.

        A transfer in ``waiting`` (its first attempt still queued for the window) waits for us, not for its
        receiver.
        """
        out: list[Output] = []
        for tid, (route, outgoing) in list(self._outgoing.items()):
            if tid in waiting:
                outgoing.touch(now)
            out += [Outbound(route, frame, tid) for frame in outgoing.poll(now)]
            if outgoing.failed:
                del self._outgoing[tid]
                log.warning("%s: transfer %s failed: %s", self._name, tid, outgoing.failed)
                out.append(Settled(tid, outgoing.failed))
        return out
