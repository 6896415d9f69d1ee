"""FedBuff's durable side: journal, then fold, then acknowledge; a kill -9 loses no acknowledged update.

The run directory keeps an async run as it keeps rounds, with model versions in the place of rounds: version v is
committed by :meth:`~coordinator.run.rundir.RunDir.complete_round` (its state and metrics line, atomically), and the
updates folded toward the next version sit in that version's journal, each written before it is folded and
before its receipt, one entry per (device, ticket).

A ticket is one assignment: a number unique and increasing within the run, which travels as the wire's round
number, so the agent's rules hold unchanged (it trains each ticket once, sends a stored update again for a ticket
sent again, and drops an older one when a newer arrives). Each ticket is logged with its device, model version and
level before the assignment leaves (``async/tickets.jsonl``), so an upload names the version it trained on through
its ticket. The versions an update may still be folded against (``max_staleness`` + 1 of them) are kept as files
(``async/version-N.safetensors``). A resume loads the last committed version and those bases, reads back who holds
which ticket, and folds the open journal again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.asynchronous import AsyncSettings
from coordinator.rounds.fedbuff import FedBuff, Published
from coordinator.run.rundir import RunDir
from coordinator.strategies.base import Assignment, ClientSlot, Strategy
from device_agent.common.atomic import append_line, atomic_write
from device_agent.wire.codec import decode_tensors, header_specs
from device_agent.wire.payload import PayloadDigest
from device_agent.wire.protocol import split_upload

log = logging.getLogger("fedfleet.async")

ASYNC_DIR = "async"
TICKETS_FILE = "tickets.jsonl"
FOLDED_FILE = "folded.txt"
"""Tickets folded, one a line, each written after its fold and before the version holding it is committed."""


@dataclass(frozen=True)
class Ticket:
    """One assignment: which device was sent which model version, at which level."""

    number: int
    device: str
    version: int
    level: float


class AsyncLedger:
    """A :class:`~coordinator.rounds.fedbuff.FedBuff` over ``strategy`` whose every acknowledged update is durable.

    Opening it on a run directory resumes where the last process stopped (module doc).
    """

    def __init__(self, rundir: RunDir, strategy: Strategy, settings: AsyncSettings) -> None:
        self.rundir = rundir
        self.folder = rundir.path / ASYNC_DIR
        self.folder.mkdir(exist_ok=True)
        resume = rundir.resume()
        strategy.load_state_dict(resume.state)
        self.server = FedBuff(strategy, settings, version=resume.last_completed_round)
        self.server.restore(self._bases())
        self.tickets: dict[int, Ticket] = {}
        self.folded: set[int] = set()
        """Tickets whose update is in the model or in the open version's journal."""
        if not self._base_path(self.version).exists():
            atomic_write(self._base_path(self.version), save_tensors(self.server.base(self.version)))
        self._read_tickets()
        self.replayed: Published | None = None
        """A version the replayed journal filled (the last process died before committing it): the caller
        evaluates and commits it as it would a live one."""
        for entry in resume.journal:  # the open version's updates, folded again in the order they were
            ticket = self.tickets[int(entry.meta["ticket"])]
            samples = int(entry.meta["samples"])
            self.server.in_flight[ticket.device] = ticket.version
            upload, extras = split_upload(self.rundir.load_upload(entry))
            self.replayed = self.server.fold(self._slot(ticket, samples), ticket.version, upload, samples, extras)
            if ticket.number not in self.folded:  # killed between its journal and this line: its version's journal
                append_line(self.folder / FOLDED_FILE, str(ticket.number))  # is not read again once committed
            self.folded.add(ticket.number)
            log.info(
                "version %d: replayed %s's journaled update (ticket %d)", self.version + 1, ticket.device, ticket.number
            )
        latest: dict[str, Ticket] = {}
        for ticket in self.tickets.values():
            latest[ticket.device] = ticket
        for device, ticket in latest.items():  # still training: their update will be folded when it comes
            if ticket.number not in self.folded:
                self.server.in_flight[device] = ticket.version
        self._next = max(self.tickets, default=0) + 1

    @property
    def version(self) -> int:
        return self.server.version

    def assign(self, slot: ClientSlot) -> tuple[Ticket, Assignment]:
        """The newest version for ``slot``'s device under a new ticket, logged before it may leave."""
        version, assignment = self.server.assign(slot)
        ticket = Ticket(self._next, slot.client_id, version, slot.level)
        append_line(self.folder / TICKETS_FILE, json.dumps(vars(ticket)))
        self.tickets[ticket.number] = ticket
        self._next += 1
        return ticket, assignment

    def accept(
        self, device: str, ticket_number: int, transfer: str, data: bytes, samples: int
    ) -> tuple[str, Published | None]:
        """Check, journal, fold: ("accepted", the new version if this update filled the buffer) or ("duplicate",
        None) for an update already folded; ``UpdateRejected`` says why one is refused. Answer the device after."""
        ticket = self.ticket(device, ticket_number)
        if ticket is None:
            return "duplicate", None
        upload, extras, _ = self.check(ticket, data, samples)
        return self.fold(ticket, transfer, data, samples, upload, extras)

    def ticket(self, device: str, ticket_number: int) -> Ticket | None:
        """The device's live ticket of that number, None when its update is already folded (a duplicate), or
        ``UpdateRejected`` (``wrong_round``) for a ticket not the device's or superseded by a newer one."""
        ticket = self.tickets.get(ticket_number)
        if ticket is None or ticket.device != device:
            raise UpdateRejected(
                f"{device!r}: ticket {ticket_number} is not an assignment of this device", "wrong_round"
            )
        if ticket_number in self.folded:
            return None
        newest = max(t.number for t in self.tickets.values() if t.device == device)
        if ticket_number != newest:
            raise UpdateRejected(f"{device!r}: ticket {ticket_number} was superseded by ticket {newest}", "wrong_round")
        return ticket

    def check(self, ticket: Ticket, data: bytes, samples: int) -> tuple[dict[str, Tensor], dict[str, Tensor], int]:
        """(upload, extras, staleness) of an upload for ``ticket``: its header against the strategy's upload contract
        before anything is decoded, then its values and staleness (``TooStale``); changes nothing."""
        slot = self._slot(ticket, samples)
        contract = self.server.strategy.upload_contract(slot)  # from the header first: nothing decoded if off it
        contract.check_specs(*split_upload(header_specs(data)))
        upload, extras = split_upload(decode_tensors(data))
        stale = self.server.check(slot, ticket.version, upload, samples, extras)
        return upload, extras, stale

    def fold(
        self,
        ticket: Ticket,
        transfer: str,
        data: bytes,
        samples: int,
        upload: Mapping[str, Tensor],
        extras: Mapping[str, Tensor] | None,
        meta: Mapping[str, object] | None = None,
        verified: PayloadDigest | None = None,
    ) -> tuple[str, Published | None]:
        """Journal ``data`` (what is folded: ``upload`` and ``extras`` as :meth:`check` gave them, or as the gate
        clipped them), then fold it: ("accepted", the new version if it filled the buffer), or ("duplicate", None)
        when the journal already has it. ``meta``: more to journal beside what a resume needs."""
        journaled = {
            **(meta or {}),
            "ticket": ticket.number,
            "version": ticket.version,
            "samples": samples,
            "level": ticket.level,
        }
        key = f"{ticket.device}@{ticket.number}"  # a fast device sends several updates toward one version
        if not self.rundir.accept_upload(self.version + 1, key, transfer, data, journaled, verified):
            return "duplicate", None
        published = self.server.fold(self._slot(ticket, samples), ticket.version, upload, samples, extras)
        self.folded.add(ticket.number)
        append_line(self.folder / FOLDED_FILE, str(ticket.number))  # a crash before this line: the journal has it
        return "accepted", published

    def commit(self, published: Published, metrics) -> None:
        """Make ``published`` durable (after static BN, which the caller ran and :meth:`FedBuff.remember`ed):
        its base for stale updates, then the run directory's atomic commit; old bases are removed."""
        version = published.version
        atomic_write(self._base_path(version), save_tensors(self.server.base(version)))
        self.rundir.complete_round(version, self.server.strategy.state_dict(), metrics)
        for path in self.folder.glob("version-*.safetensors"):
            if int(path.stem.split("-")[1]) < version - self.server.settings.max_staleness:
                path.unlink()

    def _slot(self, ticket: Ticket, samples: int) -> ClientSlot:
        return ClientSlot(ticket.device, ticket.level, max(1, samples))

    def _base_path(self, version: int) -> Path:
        return self.folder / f"version-{version:06d}.safetensors"

    def _bases(self) -> Mapping[int, dict[str, Tensor]]:
        found = {}
        for path in self.folder.glob("version-*.safetensors"):
            found[int(path.stem.split("-")[1])] = load_tensors(path.read_bytes())
        return found

    def _read_tickets(self) -> None:
        """The tickets logged and those folded; a torn last line was never committed (never sent, never folded)."""
        for line in _lines(self.folder / TICKETS_FILE):
            raw = json.loads(line)
            ticket = Ticket(int(raw["number"]), str(raw["device"]), int(raw["version"]), float(raw["level"]))
            self.tickets[ticket.number] = ticket
        self.folded = {int(line) for line in _lines(self.folder / FOLDED_FILE)}


def _lines(path: Path) -> list[str]:
    """The committed lines of an append-only log; a torn last line is cut off, so the next append starts clean."""
    if not path.exists():
        return []
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        atomic_write(path, text.encode())
    return text.splitlines()


__all__ = ["AsyncLedger", "Ticket"]
