"""Every peer's incoming transfers at one endpoint: one :class:`IncomingTransfers` per route a peer is answered on,
an admission's bounds on new transfers, and a rule refusing stale ones (closed rounds).

Pure bookkeeping: each call returns the answers to send and the payloads completed. Where a chunk is hashed is
the caller's choice (it passes ``intact`` when it hashed the chunk elsewhere, e.g. on a pool of threads).
"""

from __future__ import annotations

from collections.abc import Callable

from device_agent.wire.engine.admission import Admission, PeerOf
from device_agent.wire.engine.events import NOTHING, Arrived, Outbound, Output, Outputs
from device_agent.wire.engine.incoming import Completed, IncomingTransfers
from device_agent.wire.messages import Error, Manifest, Message, encode


class Receivers:
    """Incoming transfers by the route each peer is answered on.

    ``admission`` (a receiver facing untrusted peers) bounds new transfers per peer and in all and makes each
    peer's :class:`IncomingTransfers`; without one, each gets default bounds and ``nack_after``.
    """

    def __init__(self, nack_after: float, peer_of: PeerOf, admission: Admission | None = None) -> None:
        self._nack_after = nack_after
        self._peer_of = peer_of
        self._admission = admission
        self.peers: dict[str, IncomingTransfers] = {}
        self._open: dict[str, IncomingTransfers] = {}
        """The peers with an unfinished transfer (kept by :meth:`_track`): a coordinator's timer and admission ask
        these, not all of its 1,000 peers, several times a second."""
        self._stale: tuple[Callable[[Manifest], bool], str] | None = None

    def __bool__(self) -> bool:
        return bool(self._open)

    def receiving(self) -> list[str]:
        """Ids of inbound transfers started but not yet complete."""
        return [tid for transfers in self._open.values() for tid in transfers.pending()]

    def on_chunk(
        self, route: str, transfer: str, index: int, data: bytes | memoryview, digest: bytes, now: float, intact: bool
    ) -> Outputs:
        """File one chunk (``intact``: whether it hashes to ``digest``) from the peer answered on ``route``."""
        receiver = self._peer(route)
        replies, completed = receiver.on_chunk(transfer, index, data, digest, now, intact)
        if completed is not None:
            self._track(route, receiver)
        elif not replies:
            return NOTHING
        return self._outputs(route, replies, completed)

    def on_manifest(self, route: str, manifest: Manifest, now: float) -> Outputs:
        """Start, seal or resume a transfer; a new one past the admission's bounds or the stale rule is refused
        before anything is allocated for it."""
        receiver = self._peer(route)
        refusal = self._stale_refusal(manifest) or self._admission_refusal(route, receiver, manifest, now)
        replies, completed = ([refusal], None) if refusal is not None else receiver.on_manifest(manifest, now)
        self._track(route, receiver)
        return self._outputs(route, replies, completed)

    def refuse(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Answer every new transfer whose manifest is ``stale`` with an error saying ``why`` and drop the
        unfinished ones already open (replaces the last rule). How many unfinished transfers were dropped."""
        self._stale = stale, why
        dropped = 0
        for route, transfers in list(self._open.items()):
            dropped += len(transfers.drop_where(stale))
            self._track(route, transfers)
        return dropped

    def poll(self, now: float) -> list[Outbound]:
        """Nacks of stalled transfers and errors of abandoned ones."""
        out: list[Outbound] = []
        for route, transfers in list(self._open.items()):
            out += [Outbound(route, encode(reply)) for reply in transfers.poll(now)]
            self._track(route, transfers)
        return out

    def resume(self, now: float, to: str | None = None) -> list[Outbound]:
        """After a reconnect: a nack for every unfinished transfer (from route ``to`` only, if given), at once."""
        return [
            Outbound(route, encode(transfers.resume(tid, now)))
            for route, transfers in self._open.items()
            if to is None or route == to
            for tid in transfers.pending()
        ]

    def _outputs(self, route: str, replies: list[Message], completed: Completed | None) -> Outputs:
        out: list[Output] = [Outbound(route, encode(reply)) for reply in replies]
        if completed is not None:
            out.append(Arrived(route, completed))
        return out

    def _stale_refusal(self, manifest: Manifest) -> Error | None:
        if self._stale is None or not self._stale[0](manifest):
            return None
        return Error(code="rejected", transfer=manifest.transfer, detail=self._stale[1])

    def _admission_refusal(self, route: str, mine: IncomingTransfers, manifest: Manifest, now: float) -> Error | None:
        """The error answering a new transfer the admission refuses.

        Bounds hold per peer (one receiver each): a new transfer past them evicts the peer's least recently
        active one, so a sender whose old transfers were cut off is not locked out.
        """
        admission = self._admission
        if admission is None or mine.knows(manifest.transfer):
            return None
        peer = self._peer_of(route) or route
        problem = admission.manifest_problem(manifest)
        held = sum(t.pending_bytes() for t in self._open.values())
        most = admission.limits.max_total_pending_bytes
        if problem is None and held + manifest.size > most:
            problem = (
                f"the receiver holds {held} bytes of unfinished transfers from all peers (at most {most}); "
                "send it again later"
            )
        if problem is not None:
            admission.refuse(peer, "transfer_refused", f"transfer {manifest.transfer}: {problem}", now)
            return Error(code="too_large", transfer=manifest.transfer, detail=problem)
        while admission.over(manifest, len(mine.pending()), mine.pending_bytes()) and (oldest := mine.oldest()):
            _seen, tid = oldest
            mine.drop(tid)
            admission.refuse(peer, "transfer_evicted", f"unfinished transfer {tid} dropped for a newer one", now)
        return None

    def _peer(self, route: str) -> IncomingTransfers:
        transfers = self.peers.get(route)
        if transfers is None:
            if self._admission is not None:
                transfers = self._admission.limits.receiver(self._nack_after)
            else:
                transfers = IncomingTransfers(nack_after=self._nack_after)
            self.peers[route] = transfers
        return transfers

    def _track(self, route: str, transfers: IncomingTransfers) -> None:
        """Keep :attr:`_open` current after ``transfers`` changed."""
        if transfers.pending():
            self._open[route] = transfers
        else:
            self._open.pop(route, None)
