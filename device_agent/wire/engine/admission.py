"""What the engine asks of a receiver facing untrusted peers (``device_agent.wire.guard.InboundGuard`` is one).

The engine never imports a carrier's guard: it is handed one that answers these questions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from device_agent.wire.engine.incoming import IncomingTransfers
from device_agent.wire.messages import Manifest

PeerOf = Callable[[str], str | None]
"""The peer (a device) behind a route, or None where routes name no peer; the carrier knows its layout."""


class AdmissionLimits(Protocol):
    @property
    def max_total_pending_bytes(self) -> int:
        """Bytes all peers together may hold in unfinished transfers."""
        ...

    def receiver(self, nack_after: float) -> IncomingTransfers:
        """One peer's reassembly, bounded so it never refuses a transfer the admission let in."""
        ...


class Admission(Protocol):
    """Bounds on new transfers per peer and in all, and the record of every refusal."""

    @property
    def limits(self) -> AdmissionLimits: ...

    def manifest_problem(self, manifest: Manifest) -> str | None:
        """Why a new transfer is refused whatever else its peer has open, or None."""
        ...

    def over(self, manifest: Manifest, open_transfers: int, pending_bytes: int) -> bool:
        """Whether admitting ``manifest`` next to its peer's unfinished transfers breaks a per-peer bound."""
        ...

    def refuse(self, peer: str, reason: str, detail: str, now: float) -> bool:
        """Count (and log once per burst) one refusal of ``peer``'s input."""
        ...
