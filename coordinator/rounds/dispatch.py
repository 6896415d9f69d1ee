"""Sending each participant its assignment, and sending it again when the device says it is idle without one."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from coordinator.config.fleet import Fleet
from coordinator.rounds.roster import Roster
from coordinator.rounds.state import OpenRound
from coordinator.rounds.upload_gate import UploadGate, squared_norms
from coordinator.run.rundir import RunDir
from coordinator.strategies import ClientSlot, Strategy
from coordinator.transport.link import Link, Outgoing
from device_agent.wire.codec import encode_tensors
from device_agent.wire.messages import Assignment
from device_agent.wire.protocol import ASSIGNMENT_KIND, round_seed

log = logging.getLogger("fedfleet.engine")


@dataclass(frozen=True)
class Sent:
    """What a device was last sent (the model's bytes, their prepared transfer, the assignment), kept for sending it
    again: by rounds (:class:`Dispatcher`) and by async mode."""

    payload: bytes
    outgoing: Outgoing
    assignment: Assignment
    at: float  # time.monotonic() when it was sent

    def again(self, link: Link, device: str, **changes: object) -> Sent:
        """Send the model (a new transfer) and the assignment again, with ``changes`` to the message (its deadline)."""
        now = time.monotonic()
        transfer = link.send_payload(device, self.payload, self.outgoing)
        assignment = self.assignment.model_copy(update={**changes, "download": transfer})
        link.send_control(device, assignment)
        return Sent(self.payload, self.outgoing, assignment, now)


@dataclass(frozen=True)
class _Due:
    """A re-send deferred until ``when``, on an idle report that arrived at ``reported_at``."""

    when: float
    reported_at: float | None


class Dispatcher:
    """Pushes a round's assignments and owns the re-send policy.

    An idle report at least ``resend_after_s`` after the last assignment gets it sent again, unless it
    arrived less than that after the device acked its model (stale); one that comes sooner schedules the
    re-send for when it falls due (a "downloading" or "training" status cancels it), since the device may
    not say idle again before the round closes.
    """

    def __init__(
        self, link: Link, strategy: Strategy, gate: UploadGate, rundir: RunDir, fleet: Fleet, resend_after_s: float
    ) -> None:
        self.link = link
        self.strategy = strategy
        self.gate = gate
        self.rundir = rundir
        self.fleet = fleet
        self.resend_after_s = resend_after_s
        self._assigned: dict[str, Sent] = {}
        self._due: dict[str, _Due] = {}

    def clear(self) -> None:
        self._assigned.clear()
        self._due.clear()

    def push(self, open_: OpenRound, slots: Sequence[ClientSlot], roster: Roster) -> None:
        assignments = self.strategy.configure(open_.round, list(slots))
        # Devices whose payloads are byte-identical (FedHM at one level) share one prepared payload; personalized
        # strategies give each device its own payload at the same level, so the level is no key.
        outgoing: dict[bytes, Outgoing] = {}
        norms: dict[bytes, dict[str, float]] = {}
        shared: dict[bytes, bytes] = {}
        encoded: dict[tuple[tuple[str, int], ...], bytes] = {}
        order = sorted(roster.devices)
        for slot in slots:
            participant = open_.participants[slot.client_id]
            participant.bytes_up_start = self.link.bytes_up(slot.client_id)
            participant.bytes_down_start = self.link.bytes_down(slot.client_id)
            participant.trained_level = self.strategy.trained_level(slot)
            if participant.status == "accepted":
                continue
            assignment = assignments[slot.client_id]
            # Devices given the same tensor objects (one level of FedAvg, HeteroFL or FedHM) get the same bytes:
            # encoded once. Identities are safe keys here: ``assignments`` keeps every tensor alive.
            held = tuple((key, id(tensor)) for key, tensor in assignment.tensors.items())
            if held not in encoded:
                payload = encode_tensors(assignment.tensors)
                encoded[held] = shared.setdefault(payload, payload)  # one copy per distinct payload, for re-sends
            payload = encoded[held]
            if payload not in outgoing:
                outgoing[payload] = self.link.prepare(
                    payload, run=self.rundir.run_id, round=open_.round, kind=ASSIGNMENT_KIND
                )
                norms[payload] = squared_norms(assignment.tensors)
            self.gate.sent(slot.client_id, norms[payload], assignment.tensors)
            transfer = self.link.send_payload(slot.client_id, payload, outgoing[payload])
            device = roster.devices[slot.client_id].device
            seed = round_seed(self.rundir.seed, open_.round, order.index(slot.client_id))
            message = Assignment(
                run=self.rundir.run_id,
                round=open_.round,
                deadline_s=max(1.0, open_.deadline - time.monotonic()),
                download=transfer,
                spec=assignment.spec,
                train=self.fleet.training.for_device(device, seed),
            )
            self.link.send_control(slot.client_id, message)
            participant.assigned_at = time.monotonic()
            self._assigned[slot.client_id] = Sent(payload, outgoing[payload], message, participant.assigned_at)

    def cancel(self, device: str) -> None:
        """The device is downloading or training: no deferred re-send."""
        self._due.pop(device, None)

    def resend(self, device: str, open_: OpenRound | None, reported_at: float | None = None) -> None:
        """A participant that says it is idle mid-round without an accepted update gets its assignment again.

        It missed it (offline, or another connection with its login took it), or its upload was refused:
        either way it may still train this round. After a refusal, once. ``reported_at``: when the idle report
        arrived (``time.monotonic()``); one that arrived before the device could act on its model is stale.
        """
        sent = self._assigned.get(device)
        participant = open_.participants.get(device) if open_ is not None else None
        if open_ is None or sent is None or participant is None:
            return
        if participant.status != "assigned" and (participant.status != "rejected" or participant.retried):
            return
        now = time.monotonic()
        if now - sent.at < self.resend_after_s:
            self._due[device] = _Due(sent.at + self.resend_after_s, reported_at)
            return
        self._due.pop(device, None)
        if now >= open_.deadline or self.link.payload_in_flight(device):
            return  # a slow download still under way: the device is idle until its assignment message follows
        delivered = self.link.delivered_ago(device)
        if delivered is not None and reported_at is not None and reported_at < now - delivered + self.resend_after_s:
            # Sent before the device could act on the model it has since acked: a busy coordinator reads statuses
            # late, and re-sending on such reports doubled a 1,000-device round's downloads. A device that is
            # really idle says so again with its next heartbeat.
            return
        self._send_again(device, open_, sent)
        log.info("round %d: %s is idle without an update; its assignment was sent again", open_.round, device)

    def retry(self, open_: OpenRound, online: Collection[str]) -> list[str]:
        """The round is retried (``on_quorum_miss: retry``): every ``online`` participant without an accepted or
        failed answer is sent its assignment again; returns them. An agent still training it ignores the repeat,
        one with the update stored sends that, one that never got it or was refused trains it."""
        again = []
        for device, participant in open_.participants.items():
            sent = self._assigned.get(device)
            if sent is not None and device in online and participant.status not in ("accepted", "failed"):
                self._due.pop(device, None)
                self._send_again(device, open_, sent)
                again.append(device)
        return again

    def _send_again(self, device: str, open_: OpenRound, sent: Sent) -> None:
        again = sent.again(self.link, device, deadline_s=max(1.0, open_.deadline - time.monotonic()))
        self._assigned[device] = again
        participant = open_.participants[device]
        participant.assigned_at = again.at
        if participant.status == "rejected":  # expected to answer again: the refusal grace no longer applies
            participant.status, participant.retried = "assigned", True

    def resend_due(self, open_: OpenRound | None) -> None:
        now = time.monotonic()
        for device, due in [(d, due) for d, due in self._due.items() if due.when <= now]:
            self.resend(device, open_, due.reported_at)


__all__ = ["Dispatcher", "Sent"]
