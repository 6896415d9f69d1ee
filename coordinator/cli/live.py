"""The live terminal view of ``coordinator start``: one table of the fleet and the open round."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from rich.table import Table

from coordinator.run.metrics import RoundMetrics, is_failed

if TYPE_CHECKING:
    from coordinator.rounds.async_engine import AsyncEngine
    from coordinator.rounds.engine import RoundEngine
    from coordinator.rounds.state import DeviceState

_LEFT = {"device", "class", "online", "agent", "round status"}
"""The columns of words; the others (numbers) align right."""


def round_table(engine: RoundEngine) -> Table:
    if getattr(engine, "runs_async", False):
        return version_table(engine)  # type: ignore[arg-type]
    open_ = engine.open
    last = engine.last
    title = f"fleet {engine.fleet.fleet}: round {engine.next_round}/{engine.fleet.rounds}"
    if last is not None:
        failed = is_failed(last, engine.fleet.quorum)
        title += f"  (round {last.round}{' FAILED' if failed else ''}: {round_figures(last)}"
        title += f", {last.participants}/{len(last.devices)} updates, {last.seconds:.1f} s)"
    table = _device_table(title, "round status", "bytes up", "train s")
    for device_id, state in engine.devices.items():
        participant = open_.participants.get(device_id) if open_ else None
        up = ""
        if participant is not None:
            up = f"{participant.payload_bytes / 2**10:.0f} KiB" if participant.payload_bytes else ""
        table.add_row(
            *_device_cells(device_id, state, participant.level if participant else None),
            participant.status if participant else "-",
            up,
            f"{participant.train_seconds:.1f}" if participant and participant.train_seconds is not None else "",
        )
    return table


def _device_table(title: str, *columns: str) -> Table:
    """A table of one row a device: the columns of :func:`_device_cells`, then ``columns``."""
    table = Table(title=title)
    for column in ("device", "class", "online", "agent", "ratio", *columns):
        table.add_column(column, justify="left" if column in _LEFT else "right")
    return table


def _device_cells(device_id: str, state: DeviceState, level: float | None) -> tuple[str, ...]:
    """A device's first cells in either view: its id, class, online (or refused), the agent's state and the level it
    trains at ("-" when it trains nothing)."""
    online = "refused" if state.refused else "yes" if state.online else "no"
    ratio = "-" if level is None else str(Fraction(level).limit_denominator(1000))
    return device_id, state.device.profile, online, state.state, ratio


def round_figures(last: RoundMetrics) -> str:
    """The server's accuracy and loss, the devices' federated accuracy, or both, whichever the round has."""
    parts = []
    if last.accuracy is not None and last.loss is not None:
        parts.append(f"accuracy {last.accuracy:.3f}, loss {last.loss:.3f}")
    if last.federated_accuracy is not None:
        parts.append(f"federated accuracy {last.federated_accuracy:.3f}")
    return ", ".join(parts) or "not evaluated"


def version_table(engine: AsyncEngine) -> Table:
    """Async mode: the model version, the buffer, who trains which version, and the last version's staleness."""
    server, last = engine.server, engine.last
    title = f"fleet {engine.fleet.fleet}: version {server.version}/{engine.fleet.rounds}"
    title += f", buffer {server.buffered}/{server.settings.buffer}, {len(server.in_flight)} training"
    if last is not None and last.asynchronous is not None:
        histogram = " ".join(f"{s}:{n}" for s, n in sorted(last.asynchronous.staleness.items()))
        title += f"  (version {last.round}: {round_figures(last)}, {last.asynchronous.updates} updates"
        title += f" from {last.participants} devices, staleness {histogram}"
        title += f", {last.asynchronous.too_stale} too stale)" if last.asynchronous.too_stale else ")"
    table = _device_table(title, "trains version", "staleness now")
    for device_id, state in engine.devices.items():
        ticket = engine.holding(device_id)
        table.add_row(
            *_device_cells(device_id, state, ticket.level if ticket else None),
            f"{ticket.version} (ticket {ticket.number})" if ticket else "-",
            str(server.version - ticket.version) if ticket else "",
        )
    return table
