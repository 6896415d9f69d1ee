"""The round engine in async mode (fleet.yaml ``strategy.mode: async``; docs/async.md): FedBuff over real devices.

There are no rounds. Every online device the plan admits holds one assignment of the newest model version (a
ticket of :class:`~coordinator.rounds.async_ledger.AsyncLedger`, travelling as the wire's round number), at most
``async.concurrency`` at once. An arriving update passes the same gate as in rounds (kind, signature, run, its
ticket, the meta's bounds, the strategy's upload contract, the norm and update bounds, clipping), plus the
staleness bound (``too_stale``); it is journaled, folded, and only then acknowledged, and the device is sent the
newest version at once. Every ``async.buffer`` updates a version is published: evaluated as a round is (static BN
on the coordinator's samples), committed as the run directory commits a round (its metrics line has
:class:`~coordinator.run.metrics.AsyncMetrics`), and ``rounds`` versions end the run.

Devices offline and back: an assignment stays the device's while it is away (its stored update is taken when it
reconnects; it is sent the assignment again when it says it is idle without one), unless ``concurrency`` bounds the
fleet, where an offline device gives its slot up and is sent the newest version when it is back. A resume after a
kill -9 loads the last committed version, folds the open version's journal back in (no acknowledged update lost),
and sends each device the newest version when it says it is idle.

The loop, the roster, the planner, the gate and what observers read are
:class:`~coordinator.rounds.engine.RoundEngine`'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.asynchronous import AsyncSettings
from coordinator.config.fleet import Fleet
from coordinator.planning.planner import fmt_ratio
from coordinator.rounds.admission import describe_steps
from coordinator.rounds.async_ledger import AsyncLedger, Ticket
from coordinator.rounds.closing import round_metrics
from coordinator.rounds.dispatch import Sent
from coordinator.rounds.engine import TICK_S, RoundEngine
from coordinator.rounds.fedbuff import Published, TooStale
from coordinator.rounds.settings import EngineSettings
from coordinator.rounds.state import printable, refusal_reason
from coordinator.rounds.upload_gate import UploadGate, UploadRefused, sample_scale, squared_norms
from coordinator.run.metrics import AsyncMetrics, DeviceRoundMetrics, received_metrics
from coordinator.strategies import ClientSlot
from device_agent.wire.codec import CodecError, encode_tensors
from device_agent.wire.messages import Assignment, Error, Hello, Message, Receipt, RoundFailed, Status
from device_agent.wire.payload import Received
from device_agent.wire.protocol import ASSIGNMENT_KIND, UPDATE_KIND, ReceivedEvaluation, UploadMetaError, round_seed

log = logging.getLogger("fedfleet.async")


@dataclass
class _Contribution:
    """One device's updates folded toward the open version: its row of the version's metrics."""

    device_class: str
    level: float
    payload_bytes: int = 0
    train_seconds: float = 0.0
    host_seconds: float | None = None
    local_accuracy: float | None = None
    clipped: float | None = None
    received: ReceivedEvaluation | None = None

    def row(self, bytes_up: int, bytes_down: int) -> DeviceRoundMetrics:
        return DeviceRoundMetrics(
            device_class=self.device_class,
            ratio=self.level,
            bytes_up=max(0, bytes_up),
            bytes_down=max(0, bytes_down),
            payload_bytes=self.payload_bytes,
            train_seconds=self.train_seconds,
            host_seconds=self.host_seconds,
            status="accepted",
            local_accuracy=self.local_accuracy,
            clipped=self.clipped,
            **received_metrics(self.received),
        )


@dataclass
class _Window:
    """What happened since the last published version."""

    started: float = field(default_factory=time.monotonic)
    devices: dict[str, _Contribution] = field(default_factory=dict)
    too_stale: int = 0


class AsyncEngine(RoundEngine):
    """Publishes ``fleet.rounds`` model versions of FedBuff over ``strategy`` (FedAvg or FedHM) and ``link``."""

    runs_async = True

    @classmethod
    def settings_for(cls, settings: EngineSettings) -> EngineSettings:
        """The peer check compares one round's updates at its close: async has neither, so it is off."""
        return replace(settings, gate=replace(settings.gate, peer_min_cosine=None))

    def _resume(self) -> None:
        """Open the ledger where the last process stopped (it replays the open version's journal) and start with
        no device holding a ticket of this process."""
        async_settings = self.fleet.strategy.asynchronous
        if async_settings is None:  # parse_fleet gives every async fleet its settings
            raise ValueError("strategy.mode: async without strategy.async settings")
        self.async_settings: AsyncSettings = async_settings
        self.ledger = AsyncLedger(self.rundir, self.strategy, async_settings)
        self.server = self.ledger.server
        self.next_round = self.ledger.version + 1
        self._journal = []  # the ledger replayed the open version's journal
        self._sent: dict[str, Sent] = {}
        """Devices holding a live ticket (the assignment's round number) of this process: what they were sent."""
        self._idle: dict[str, float] = {}
        """Devices that said they are idle while holding a live ticket: when they said so."""
        self._hold: dict[str, float] = {}
        """Devices whose assignment failed: not sent another before this time (no failure loop)."""
        self._replan = True
        self._levels_said: dict[str, float | None] = {}
        self._payloads: dict[float, tuple[bytes, dict[str, float], dict[str, Tensor]]] = {}
        """Per level, the newest version's encoded assignment, its squared norms and tensors (one encoding each)."""
        self._window = _Window()
        self._bytes: dict[str, tuple[int, int]] = {}
        """Per device, its link counters (up, down) when its last version row was made."""
        self._assigned_at: dict[str, float] = {}
        self.too_stale = 0
        """Updates refused as too stale in this process."""

    @property
    def version(self) -> int:
        """The newest published model version."""
        return self.ledger.version

    def run(self, progress: Callable[[RoundEngine], None] = lambda _e: None) -> bool:
        """Until ``fleet.rounds`` versions are published (True) or :meth:`stop` (False); the link stops on return."""
        self._listen()
        try:
            if not self._wait_for_devices(progress):
                return False
            self._window.started = time.monotonic()  # the first version's time counts from its first assignment
            if self.ledger.replayed is not None:  # the journal filled a version the last process did not commit
                self._publish(self.ledger.replayed)
            if self.async_settings.concurrency is not None:  # resumed tickets of devices still away: slots free
                for device in [d for d in self.server.in_flight if not self.devices[d].online]:
                    self.server.release(device)
            while self.version < self.fleet.rounds and not self.stopping.is_set():
                self._assign_free()
                self._pump(time.monotonic() + TICK_S, progress)
                self._resend_due()
            return self.version >= self.fleet.rounds
        finally:
            self.link.stop()

    # ---- assignments -----------------------------------------------------------------------------

    def _level(self, device: str) -> float | None:
        """The device's level by its profile (the planner's, as rounds plan it), None when it cannot train."""
        if self._replan:
            plans = self.draw.planner(self.fleet, self.roster.catalog, self.roster.profiles(), self.draw.ceilings)
            self.draw.plans = {p.device: p for p in plans}
            self._replan = False
        plan = self.draw.plans.get(device)
        level = None if plan is None or plan.ratio is None else float(plan.ratio)
        if self._levels_said.get(device, -1.0) != level:
            why = f"at level {fmt_ratio(level)}" if level is not None else f"out ({plan.reason if plan else 'no plan'})"
            log.info("%s: %s", device, why)
            self._levels_said[device] = level
        return level

    def _assign_free(self) -> None:
        """Send the newest version to every online device without a live ticket, within ``concurrency``;
        the devices assigned longest ago first."""
        now = time.monotonic()
        waiting = [
            d
            for d in self.roster.online()
            if d not in self._sent and self._hold.get(d, 0.0) <= now and self.devices[d].refused is None
        ]
        for device in sorted(waiting, key=lambda d: self._assigned_at.get(d, 0.0)):
            if device not in self.server.in_flight and not self.server.can_assign():
                return
            self._assign(device)

    def _assign(self, device: str) -> None:
        level = self._level(device)
        if level is None:
            return
        state = self.devices[device]
        slot = ClientSlot(device, level, self.fleet.samples_for(state.device))
        ticket, assignment = self.ledger.assign(slot)
        if level not in self._payloads:
            self._payloads[level] = (
                encode_tensors(assignment.tensors),
                squared_norms(assignment.tensors),
                assignment.tensors,
            )
        payload, norms, tensors = self._payloads[level]
        self.gate.sent(device, norms, tensors)
        outgoing = self.link.prepare(payload, run=self.rundir.run_id, round=ticket.number, kind=ASSIGNMENT_KIND)
        transfer = self.link.send_payload(device, payload, outgoing)
        seat = sorted(self.devices).index(device)
        message = Assignment(
            run=self.rundir.run_id,
            round=ticket.number,
            deadline_s=self.fleet.round_deadline_s,
            download=transfer,
            spec=assignment.spec,
            train=self.fleet.training.for_device(state.device, round_seed(self.rundir.seed, ticket.number, seat)),
        )
        self.link.send_control(device, message)
        self._sent[device] = Sent(payload, outgoing, message, time.monotonic())
        self._assigned_at[device] = time.monotonic()
        self._idle.pop(device, None)

    def _resend_due(self) -> None:
        """A device that said it is idle while holding a live ticket gets it again once ``resend_after_s`` passed
        since it was sent (it missed it, e.g. offline): it trains it, or sends its stored update."""
        now = time.monotonic()
        for device, _reported in list(self._idle.items()):
            sent = self._sent.get(device)
            if sent is None or not self.devices[device].online:
                self._idle.pop(device, None)
                continue
            if now - sent.at < self.settings.resend_after_s or self.link.payload_in_flight(device):
                continue
            delivered = self.link.delivered_ago(device)
            if delivered is not None and delivered < self.settings.resend_after_s:
                continue  # the model just arrived: the idle report may predate it
            self._sent[device] = sent.again(self.link, device)
            self._idle.pop(device, None)
            log.info("%s is idle without an update; ticket %d sent again", device, sent.assignment.round)

    def _free(self, device: str) -> None:
        """The device's ticket is answered or given up: its concurrency slot is free."""
        self._sent.pop(device, None)
        self._idle.pop(device, None)
        self.server.release(device)

    @property
    def gate(self) -> UploadGate:
        return self.admission.gate

    def holding(self, device: str) -> Ticket | None:
        """The ticket ``device`` trains (sent by this process and not answered yet), for the live table."""
        sent = self._sent.get(device)
        return None if sent is None else self.ledger.tickets[sent.assignment.round]

    # ---- messages --------------------------------------------------------------------------------

    def _on_message(self, device: str, message: Message, arrived: float | None = None) -> None:
        if device not in self.devices:
            log.warning("message from %r, which is not in the fleet; ignored", device)
            return
        if isinstance(message, Status):
            if not self.roster.status(device, message):
                return
            if message.state == "offline" and self.async_settings.concurrency is not None:
                if device in self._sent:
                    log.info("%s went offline: its slot goes to another device (async.concurrency)", device)
                self._free(device)
            elif message.state in ("idle", "online") and device in self._sent:
                reported = time.monotonic() if arrived is None else arrived
                if reported >= self._sent[device].at:  # one that came before the assignment left says nothing of it
                    self._idle.setdefault(device, reported)
            else:
                self._idle.pop(device, None)
            return
        if isinstance(message, RoundFailed):
            self._failed(device, message)
            return
        if isinstance(message, Hello):
            self._replan = True  # a new measured profile: the planner may size it otherwise
        super()._on_message(device, message, arrived)

    def _failed(self, device: str, failure: RoundFailed) -> None:
        ticket = self.holding(device)
        if ticket is None or failure.run != self.rundir.run_id or failure.round != ticket.number:
            return
        log.warning(
            "%s failed ticket %d (version %d): %s: %s",
            device,
            ticket.number,
            ticket.version,
            failure.reason,
            printable(failure.detail, 480),
        )
        if failure.reason == "out_of_memory":
            self.draw.out_of_memory(device, ticket.level)
            self._replan = True
        self._free(device)
        self._hold[device] = time.monotonic() + self.settings.resend_after_s

    def _on_transport_refusal(self, device: str, reason: str) -> None:
        self.refused.count(device, reason)
        if reason == "transfer_refused" and device in self._sent:
            self._free(device)  # the upload will not come: the device is sent the newest version

    def _on_payload(self, device: str, received: Received) -> None:
        if device not in self.devices:
            log.warning("payload from %r, which is not in the fleet; ignored", device)
            return
        try:
            status, published = self._admit(device, received)
        except (UpdateRejected, UploadMetaError, CodecError) as exc:
            if isinstance(exc, TooStale):
                self.too_stale += 1
                self._window.too_stale += 1
            reason = refusal_reason(exc)
            log.warning("rejected %s's update of ticket %d (%s): %s", device, received.round, reason, exc)
            self.refused.upload(device, received.round, reason, str(exc))
            self.link.send_control(device, Error(code="rejected", detail=str(exc)[:1000], transfer=received.transfer))
            sent = self._sent.get(device)
            if sent is not None and sent.assignment.round == received.round:
                self._free(device)  # it trains the newest version next
            return
        self.link.send_control(
            device, Receipt(run=received.run, round=received.round, transfer=received.transfer, status=status)
        )
        if published is not None:
            self._publish(published)
        if status == "accepted":
            self._free(device)
            if self.version < self.fleet.rounds:  # the newest version at once: to the device waiting longest
                self._assign_free()

    def _admit(self, device: str, received: Received) -> tuple[str, Published | None]:
        """The upload gate for one update (module doc): ("accepted" or "duplicate", a version it published)."""
        if received.kind != UPDATE_KIND:
            raise UploadRefused("wrong_kind", f"expected a transfer of kind {UPDATE_KIND!r}, got {received.kind!r}")
        if self.admission.signatures is not None:
            self.admission.signatures.check(device, received)
        if received.run != self.rundir.run_id:
            raise UploadRefused("wrong_run", f"update for run {received.run!r}, but this run is {self.rundir.run_id!r}")
        ticket = self.ledger.ticket(device, received.round)
        if ticket is None:
            return "duplicate", None
        expected = self.admission.expected_samples(device)
        parsed = self.gate.meta(received.meta, expected)
        data = received.data
        try:
            upload, extras, stale = self.ledger.check(ticket, data, parsed.samples)
            weight = self.gate.sample_weight(parsed.samples, expected)
            scale = sample_scale(weight, self.admission.typical_samples or expected)  # as rounds bound it
            screened = self.gate.norm(device, ticket.level, upload, scale)
        except (UpdateRejected, CodecError):
            raise
        except Exception as exc:  # one device's bytes must never stop the engine, whatever they trip over
            raise UploadRefused("other", f"the update could not be checked: {type(exc).__name__}: {exc}") from exc
        meta: dict[str, object] = {
            "staleness": stale,
            "train_seconds": parsed.train_seconds,
            "host_seconds": parsed.host_seconds,
            "loss": parsed.loss,
            "payload_bytes": len(data),
            "local_accuracy": parsed.local_accuracy,
            "update_norms": screened.update_norms,
        }
        if screened.steps:  # the journal keeps what is folded, so a replay folds the same
            meta["clipped"] = screened.steps
            data = encode_tensors({**upload, **extras, **screened.upload})
            log.info("version %d: clipped %s's update (%s)", self.version + 1, device, describe_steps(screened.steps))
        verified = None if screened.steps else received.digest
        status, published = self.ledger.fold(
            ticket, received.transfer, data, weight, screened.upload, extras, meta, verified
        )
        if status == "accepted":
            self.gate.accepted(ticket.level, screened, device)
            self._contributed(device, ticket, len(received.data), parsed, screened.steps)
        return status, published

    def _contributed(self, device: str, ticket: Ticket, payload_bytes: int, parsed, steps: dict[str, float]) -> None:
        row = self._window.devices.get(device)
        if row is None:
            row = self._window.devices[device] = _Contribution(self.devices[device].device.profile, ticket.level)
        row.level = ticket.level
        row.payload_bytes += payload_bytes
        row.train_seconds += parsed.train_seconds
        if parsed.host_seconds is not None:
            row.host_seconds = (row.host_seconds or 0.0) + parsed.host_seconds
        row.local_accuracy, row.received = parsed.local_accuracy, parsed.received
        if steps:
            row.clipped = min(steps.values()) if row.clipped is None else min(row.clipped, *steps.values())

    # ---- versions --------------------------------------------------------------------------------

    def _publish(self, published: Published) -> None:
        """Evaluate the new version as a round is evaluated, then commit it with its metrics line."""
        closing = time.monotonic()
        window, self._window = self._window, _Window()
        server = self.closer.evaluate()
        self.server.remember()  # static BN changed the model in place: the version's base is the calibrated one
        self._payloads.clear()
        self.gate.history.next_round()  # the update bound learns from the versions before, as from rounds before
        self.gate.direction.next_round()
        evaluated = time.monotonic()
        devices = {}
        for device, row in window.devices.items():  # bytes since the device's row of the version before
            up, down = self.link.bytes_up(device), self.link.bytes_down(device)
            before = self._bytes.get(device, (0, 0))
            devices[device] = row.row(up - before[0], down - before[1])
            self._bytes[device] = (up, down)
        staleness = Counter(update.staleness for update in published.updates)
        received = (row.received for row in window.devices.values())
        metrics = round_metrics(
            published.version, devices, received, server, evaluated - window.started, {"evaluate": evaluated - closing}
        )
        metrics = metrics.model_copy(
            update={
                # a version the resume replayed has no rows: its devices are counted from the ledger
                "participants": len(devices) or len({u.device for u in published.updates}),
                "asynchronous": AsyncMetrics(
                    updates=len(published.updates),
                    staleness=dict(sorted(staleness.items())),
                    too_stale=window.too_stale,
                    in_flight=len(self.server.in_flight),
                ),
            }
        )
        self.ledger.commit(published, metrics)
        self.last = metrics
        self.next_round = published.version + 1
        log.info(
            "version %d published: %d updates from %d devices, staleness %s%s, %s, %.1f s",
            published.version,
            len(published.updates),
            metrics.participants,
            " ".join(f"{s}:{n}" for s, n in sorted(staleness.items())),
            f", {window.too_stale} too stale" if window.too_stale else "",
            "no server evaluation" if server is None else "accuracy {:.4f}, loss {:.4f}".format(*server),
            metrics.seconds,
        )


def engine_class(fleet: Fleet) -> type[RoundEngine]:
    """The engine that runs ``fleet``: :class:`AsyncEngine` for ``strategy.mode: async``, else rounds."""
    return AsyncEngine if fleet.strategy.mode == "async" else RoundEngine


__all__ = ["AsyncEngine", "engine_class"]
