"""What the engine hands back: frames to send and events to act on. A carrier sends the one, a join the other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from device_agent.wire.engine.incoming import Completed


@dataclass(frozen=True, slots=True)
class Outbound:
    """A frame to send to ``route``; ``transfer`` names the outgoing transfer it belongs to (None: an answer)."""

    route: str
    data: bytes
    transfer: str | None = None


@dataclass(frozen=True, slots=True)
class Arrived:
    """A complete, verified payload from the peer answered on ``route``: handed over exactly once."""

    route: str
    completed: Completed


@dataclass(frozen=True, slots=True)
class Settled:
    """An outgoing transfer ended: its receiver acked it (``error`` None), or it failed.

    ``refused``: the receiver answered with an error (it will not take these bytes), so sending them again is
    pointless.
    """

    transfer: str
    error: str | None = None
    refused: bool = False


Output = Outbound | Arrived | Settled
Outputs = Sequence[Output]
NOTHING: Outputs = ()
"""What most frames produce (a chunk in the middle of a transfer): shared, so the common case allocates nothing."""
