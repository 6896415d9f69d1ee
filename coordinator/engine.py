"""The round engine: any strategy's rounds over any :class:`~coordinator.link.Link`, durable across restarts.

One thread owns every piece of round state. The link's threads only enqueue events (hello,
status, uploads, failures) and the engine's loop applies them in order, so validation, journaling,
folding and answering an upload happen as one step and need no locks. The wire side of a round is
described in :mod:`device_agent.protocol`. ``coordinator start`` runs it over MQTT
(:class:`~coordinator.link.MqttLink`); the simulation and ``benchmarks.compare`` over in-process
devices (:class:`~coordinator.local_link.InProcessLink`): one round core for both.

The upload gate (:meth:`RoundEngine._accept`), in order: the signature (with ``security.sign_uploads``;
before any receipt, so a forgery is never answered ``duplicate``) -> envelope (kind, run, round,
participant, duplicate) -> the update's meta (every number within its range of
:data:`device_agent.wire.bounds.UPLOAD_META`) -> decode -> only the extras the strategy declares ->
the strategy's checks for that slot (names, shapes, dtypes, finite values, magnitude) -> journal ->
fold. Nothing touches the aggregate before the journal has the upload, so a refused or late upload
never counts.

Durability: the round's participants and levels are written to ``open-round.json`` before any
assignment leaves, every accepted upload is journaled (``RunDir.accept_upload``) before it is folded
and before its receipt is sent, and closing a round is ``RunDir.complete_round``'s atomic commit. A restart on
the same run directory reloads the last global state, re-opens the same round with the same
participants, folds the journal back in and re-sends the assignments; devices that already
trained re-send their stored update instead of training again.

Personalized strategies (Factorized-FL): the coordinator keeps each client's personalized factors
in the strategy state (checkpointed with the round), the devices keep their private part. The
global model evaluated here is then only a reference; the round's ``personalized_accuracy`` is the
mean of the ``local_accuracy`` each device reports in its upload meta (its trained model on its own
test shard). A device that lost its private part says ``state_lost`` and is started over.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.compatibility import release_note
from coordinator.evaluation import evaluate_global
from coordinator.fleet import Device, Fleet
from coordinator.limits import FleetLimits
from coordinator.link import Link
from coordinator.metrics import DeviceRoundMetrics, DeviceStatus, RoundMetrics, received_metrics
from coordinator.planner import DevicePlan, after_out_of_memory, fmt_ratio, plan_fleet, why_no_one
from coordinator.round_close import journaled_meta, round_metrics
from coordinator.rundir import OPEN_ROUND_FILE, JournalEntry, RoundNotOpen, RunDir
from coordinator.signing import UploadSignatures
from coordinator.steady_reports import SteadyReports
from coordinator.strategies import ClientSlot, RoundAggregate, Strategy
from coordinator.upload_gate import (
    GateSettings,
    UploadGate,
    UploadRefused,
    check_dtypes,
    check_extras,
    profile_problem,
    squared_norms,
)
from device_agent.atomic import atomic_write
from device_agent.data.datasets import LabeledData
from device_agent.probe import DeviceProfile
from device_agent.protocol import (
    ASSIGNMENT_KIND,
    UPDATE_KIND,
    ReceivedEvaluation,
    UploadMetaError,
    round_seed,
    split_upload,
)
from device_agent.wire.codec import CodecError, decode_tensors, encode_tensors
from device_agent.wire.messages import (
    INCOMPATIBLE,
    Assignment,
    Error,
    Hello,
    Manifest,
    Message,
    Receipt,
    RoundFailed,
    Status,
)
from device_agent.wire.transfer import Completed
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.engine")


def refusal_reason(exc: Exception) -> str:
    """A bounded label for why an upload was refused: the error's ``reason`` code or its kind."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason:
        return reason
    return {UpdateRejected: "rejected", UploadMetaError: "bad_meta", CodecError: "bad_payload"}.get(type(exc), "other")


@dataclass(frozen=True)
class Refusal:
    """One refused upload, kept for the status page (the engine keeps the last ``RECENT_REFUSALS``)."""

    device: str
    round: int
    reason: str
    detail: str
    time: float


RECENT_REFUSALS = 50


def printable(text: str, limit: int = 200) -> str:
    """A device-chosen string fit for one log line: no control characters, bounded length."""
    clean = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return clean + ("..." if len(text) > limit else "")


Planner = Callable[
    [Fleet, Mapping[str, DeviceClass], Mapping[str, DeviceProfile], Mapping[str, float]], list[DevicePlan]
]
"""Who trains at which level: :func:`~coordinator.planner.plan_fleet` for a fleet; fixed levels in a simulation."""


@dataclass
class DeviceState:
    """What the coordinator knows about one fleet device right now."""

    device: Device
    online: bool = False
    state: str = "unknown"
    profile: DeviceProfile | None = None
    agent_version: str | None = None
    refused: str | None = None
    """Why the coordinator will not work with this device (another protocol version), until it says hello."""


@dataclass
class Participant:
    """One device's part in the open round."""

    level: float
    trained_level: float | None = None
    """The level the device actually trains (a fixed-width strategy may differ from the plan)."""
    status: str = "assigned"
    bytes_up_start: int = 0
    bytes_down_start: int = 0
    payload_bytes: int = 0
    train_seconds: float | None = None
    host_seconds: float | None = None
    error: str | None = None
    local_accuracy: float | None = None
    rejected_at: float = math.inf
    retried: bool = False
    """Its assignment was sent again after a refusal (once per round: a device that keeps failing is not retrained)."""
    received: ReceivedEvaluation | None = None


@dataclass
class OpenRound:
    round: int
    participants: dict[str, Participant]
    aggregate: RoundAggregate
    deadline: float
    started: float
    extended: bool = False
    phases: dict[str, float] = field(default_factory=dict)

    def answered(self, devices: dict[str, DeviceState], rejected_before: float = math.inf) -> bool:
        """Every participant accepted, failed, offline, or refused at or before ``rejected_before`` (monotonic).

        A fresh refusal is no answer yet: the device may still send a valid update, which must not be late.
        """
        return all(
            p.status in ("accepted", "failed")
            or (p.status == "rejected" and p.rejected_at <= rejected_before)
            or not devices[d].online
            for d, p in self.participants.items()
        )

    @property
    def accepted(self) -> list[str]:
        return [d for d, p in self.participants.items() if p.status == "accepted"]


_FLEET_DEFAULTS = FleetLimits()
"""fleet.yaml's ``limits`` left out: an engine built without a fleet waits on assignments the same way."""


@dataclass(frozen=True)
class EngineSettings:
    min_devices: int
    wait_timeout_s: float = 600.0
    calibration_samples: int = 1024
    gate: GateSettings = field(default_factory=GateSettings)
    resend_after_s: float = _FLEET_DEFAULTS.resend_after_s
    """An assignment is sent again to a participant that says it is idle at least this long after the last one."""
    rejected_grace_s: float = _FLEET_DEFAULTS.rejected_grace_s
    """How long a refused participant may still send a valid update before the round stops waiting for it."""

    @classmethod
    def of(cls, fleet: Fleet, min_devices: int, wait_timeout_s: float) -> EngineSettings:
        """A run's settings with what fleet.yaml's ``limits`` says of updates and assignments."""
        limits = fleet.limits
        return cls(
            min_devices,
            wait_timeout_s,
            gate=limits.gate(),
            resend_after_s=limits.resend_after_s,
            rejected_grace_s=limits.rejected_grace_s,
        )


class RoundEngine:
    """Runs ``fleet.rounds`` rounds of ``strategy`` over ``session`` and records them in ``rundir``."""

    def __init__(
        self,
        fleet: Fleet,
        catalog: dict[str, DeviceClass],
        strategy: Strategy,
        rundir: RunDir,
        data: LabeledData,
        link: Link,
        settings: EngineSettings,
        planner: Planner = plan_fleet,
        signatures: UploadSignatures | None = None,
    ) -> None:
        """``signatures``: the fleet's upload signature check (``security.sign_uploads``), None when off."""
        self.fleet = fleet
        self.signatures = signatures
        self.catalog = catalog
        self.strategy = strategy
        self.rundir = rundir
        self.data = data
        self.settings = settings
        self.devices = {d.id: DeviceState(d) for d in fleet.devices}
        self.ceilings: dict[str, float] = {}
        self.plans: dict[str, DevicePlan] = {}
        self.reports = SteadyReports()
        self._last_plan: tuple[int, str] | None = None
        # Observability counters read by metrics exporters: (device, reason) -> refused uploads, and
        # device -> out-of-memory step-downs. Reasons are short snake_case codes (a bounded label set).
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.step_downs: Counter[str] = Counter()
        self.recent_refusals: deque[Refusal] = deque(maxlen=RECENT_REFUSALS)
        self.open: OpenRound | None = None
        self.last: RoundMetrics | None = None
        self.stopping = threading.Event()
        self._events: queue.Queue[Callable[[], None]] = queue.Queue()
        self._deferred: list[tuple[str, Completed]] = []
        self.link = link
        self.planner = planner
        self.gate = UploadGate(settings.gate)
        # device -> (payload, its manifest, the assignment, when it was last sent), for re-sending it.
        self._assigned: dict[str, tuple[bytes, Manifest, Assignment, float]] = {}
        # device -> when a deferred re-send falls due: it said idle too soon after its assignment to tell
        # a lost assignment from one still on its way, and may not say idle again before the round closes.
        self._resend_due: dict[str, float] = {}
        resume = rundir.resume()
        self.strategy.load_state_dict(resume.state)
        self.next_round = resume.next_round
        self._journal = resume.journal

    # ---- the loop ------------------------------------------------------------------------------

    def run(self, progress: Callable[[RoundEngine], None] = lambda _e: None) -> bool:
        """Run until every round is done (True) or :meth:`stop` (False). The link is stopped on return."""
        self.link.start(
            on_message=lambda device, m: self._events.put(lambda: self._on_message(device, m)),
            on_payload=lambda device, c: self._events.put(lambda: self._on_payload(device, c)),
            on_refused=lambda device, reason: self._events.put(lambda: self._on_transport_refusal(device, reason)),
        )
        try:
            if not self._wait_for_devices(progress):
                return False
            while self.next_round <= self.fleet.rounds and not self.stopping.is_set():
                if not self._run_round(self.next_round, progress):
                    return False
                self.next_round += 1
            return True
        finally:
            self.link.stop()

    def stop(self) -> None:
        self.stopping.set()

    def _pump(self, until: float, progress: Callable[[RoundEngine], None]) -> None:
        """Apply events until ``until`` (monotonic) or until the queue has been idle for a tick."""
        while not self.stopping.is_set():
            timeout = min(0.25, max(0.0, until - time.monotonic()))
            try:
                self._events.get(timeout=timeout)()
            except queue.Empty:
                break
            if time.monotonic() >= until:
                break
        progress(self)

    def _drain(self) -> None:
        """Apply every event already queued, without waiting.

        Closing a round (aggregation, evaluation) applies no events; a device that said hello meanwhile
        must count before the next round's participants are drawn, or it sits out one more round.
        """
        while True:
            try:
                self._events.get_nowait()()
            except queue.Empty:
                return

    def _wait_for_devices(self, progress: Callable[[RoundEngine], None]) -> bool:
        give_up = time.monotonic() + self.settings.wait_timeout_s
        while not self.stopping.is_set():
            online = sum(state.online for state in self.devices.values())
            if online >= self.settings.min_devices or (self._journal and online):
                return True
            if time.monotonic() > give_up:
                offline = ", ".join(d for d, s in self.devices.items() if not s.online)
                raise TimeoutError(
                    f"only {online} of the {self.settings.min_devices} devices needed came online "
                    f"within {self.settings.wait_timeout_s:.0f} s (offline: {offline}; a device that never "
                    "comes online may have the wrong fleet name, broker URL or password: `device-agent doctor`)"
                )
            self._pump(time.monotonic() + 0.5, progress)
        return False

    # ---- one round -----------------------------------------------------------------------------

    def _run_round(self, round_: int, progress: Callable[[RoundEngine], None]) -> bool:
        started = time.monotonic()
        self._drain()
        participants = self._participants(round_)
        if not participants and not self.stopping.is_set():
            log.warning(
                "round %d: no online device can take part (%s); waiting up to %.0f s",
                round_,
                why_no_one(self.plans, {d for d, s in self.devices.items() if s.online}),
                self.settings.wait_timeout_s,
            )
        while not participants and not self.stopping.is_set():
            if time.monotonic() - started > self.settings.wait_timeout_s:
                raise TimeoutError(
                    f"round {round_}: no device could take part within {self.settings.wait_timeout_s:.0f} s"
                )
            self._pump(time.monotonic() + 1.0, progress)
            participants = self._participants(round_)
        if self.stopping.is_set():
            return False
        slots = [ClientSlot(d, level, self.fleet.samples_for(self.devices[d].device)) for d, level in participants]
        atomic_write(
            self.rundir.path / OPEN_ROUND_FILE,
            json.dumps({"round": round_, "participants": dict(participants)}).encode(),
        )
        aggregate = self.strategy.open_round(round_, slots)
        self.gate.open_round()
        self._assigned.clear()
        self._resend_due.clear()
        deadline = started + self.fleet.round_deadline_s
        self.open = OpenRound(
            round_, {d: Participant(level) for d, level in participants}, aggregate, deadline, started
        )
        self._replay_journal(round_, slots)
        planned = time.monotonic()
        self._push(round_, slots)
        pushed = time.monotonic()
        deferred, self._deferred = self._deferred, []
        for device, completed in deferred:
            self._on_payload(device, completed)
        self.open.phases.update(plan=planned - started, push=pushed - planned)
        while not self.stopping.is_set():
            self._pump(self.open.deadline, progress)
            self._resend_due_assignments()
            if self.open.answered(self.devices, time.monotonic() - self.settings.rejected_grace_s):
                break
            if time.monotonic() >= self.open.deadline:
                if len(self.open.accepted) >= self._quorum() or self.fleet.on_quorum_miss == "skip":
                    break
                if self.open.extended:
                    break
                self.open.extended = True
                self.open.deadline += self.fleet.round_deadline_s
                log.warning(
                    "round %d: %d/%d updates at the deadline, below the quorum of %d; extending once by %.0f s",
                    round_,
                    len(self.open.accepted),
                    len(self.open.participants),
                    self._quorum(),
                    self.fleet.round_deadline_s,
                )
        if self.stopping.is_set():
            return False
        self._close(round_, pushed)
        progress(self)
        return True

    def _quorum(self) -> int:
        assert self.open is not None
        return max(1, math.ceil(self.fleet.quorum * len(self.open.participants)))

    def _participants(self, round_: int) -> list[tuple[str, float]]:
        """(device, level) of the round: the saved choice when resuming it, else a fresh plan and draw."""
        saved = self.rundir.path / OPEN_ROUND_FILE
        if saved.exists():
            raw = json.loads(saved.read_text())
            if raw.get("round") == round_:
                return [(d, float(level)) for d, level in raw["participants"].items() if d in self.devices]
        reports = {d: s.profile for d, s in self.devices.items() if s.profile is not None}
        self.plans = {p.device: p for p in self.planner(self.fleet, self.catalog, reports, self.ceilings)}
        eligible = sorted(d for d, s in self.devices.items() if s.online and self.plans[d].ratio is not None)
        count = math.ceil(self.fleet.participation * len(eligible))
        chosen = random.Random(self.rundir.seed * 1_000_003 + round_).sample(eligible, count)
        self._log_plan(round_, chosen)
        return [(d, float(self.plans[d].ratio)) for d in sorted(chosen)]  # type: ignore[arg-type]

    def _log_plan(self, round_: int, chosen: list[str]) -> None:
        """Why each fleet device is in or out of the round: a device that never takes part must say why."""
        parts = []
        for device, state in self.devices.items():
            plan = self.plans[device]
            if device in chosen:
                parts.append(f"{device} at {fmt_ratio(plan.ratio)}")  # type: ignore[arg-type]
            elif not state.online:
                parts.append(f"{device} out (offline)")
            elif plan.ratio is None:
                parts.append(f"{device} out ({plan.reason})")
            else:
                parts.append(f"{device} out (not drawn)")
        line = "; ".join(parts)
        if (round_, line) != self._last_plan:  # re-planned while waiting: say it again only if it changed
            log.info("round %d: %s", round_, line)
        self._last_plan = (round_, line)

    def _replay_journal(self, round_: int, slots: list[ClientSlot]) -> None:
        """Fold the uploads accepted before a restart back into the re-opened round.

        Each is checked again with today's bounds (:func:`~coordinator.round_close.journaled_meta`) and
        the strategy's checks; one that fails, or whose fold fails, is quarantined, never a stopped run.
        """
        assert self.open is not None
        open_ = self.open
        pending = [e for e in self._journal if e.round == round_ and e.device in open_.participants]
        self._journal = []
        folded: list[tuple[str, dict, int, dict]] = []
        for entry in pending:
            try:
                parsed = journaled_meta(entry.meta)
                payload_bytes = int(entry.meta.get("payload_bytes", 0))
                upload, extras = split_upload(self.rundir.load_upload(entry))
                open_.aggregate.check(entry.device, upload, parsed.samples, extras)
            except Exception as exc:  # a journal of an older release: whatever it trips over, the run goes on
                self._quarantine(entry, exc)
                continue
            try:
                open_.aggregate.fold(entry.device, upload, parsed.samples, extras)
            except Exception as exc:
                self._quarantine(entry, exc)
                # A fold that failed part-way leaves the aggregate unknown: start it over without this upload.
                open_.aggregate = self.strategy.open_round(round_, slots)
                for device, kept, samples, kept_extras in folded:
                    open_.aggregate.fold(device, kept, samples, kept_extras)
                continue
            folded.append((entry.device, upload, parsed.samples, extras))
            participant = open_.participants[entry.device]
            self.gate.accepted(participant.level, math.sqrt(sum(squared_norms(upload).values())))
            participant.status, participant.payload_bytes = "accepted", payload_bytes
            participant.train_seconds, participant.host_seconds = parsed.train_seconds, parsed.host_seconds
            participant.local_accuracy, participant.received = parsed.local_accuracy, parsed.received
            log.info("round %d: replayed %s's journaled update", round_, entry.device)

    def _quarantine(self, entry: JournalEntry, exc: Exception) -> None:
        reason = f"{refusal_reason(exc)}: {type(exc).__name__}: {printable(str(exc), 480)}"
        where = self.rundir.quarantine(entry, reason)
        log.error(
            "round %d: %s's journaled update cannot be folded or closed (%s); quarantined in %s, the round goes on "
            "without it",
            entry.round,
            entry.device,
            reason,
            where,
        )

    def _push(self, round_: int, slots: list[ClientSlot]) -> None:
        assert self.open is not None
        assignments = self.strategy.configure(round_, slots)
        # Devices whose payloads are byte-identical (FedHM at one level) share one manifest; personalized
        # strategies give each device its own payload at the same level, so the level is no key.
        manifests: dict[bytes, Manifest] = {}
        norms: dict[bytes, dict[str, float]] = {}
        shared: dict[bytes, bytes] = {}
        for slot in slots:
            participant = self.open.participants[slot.client_id]
            participant.bytes_up_start = self.link.bytes_up(slot.client_id)
            participant.bytes_down_start = self.link.bytes_down(slot.client_id)
            participant.trained_level = self.strategy.trained_level(slot)
            if participant.status == "accepted":
                continue
            assignment = assignments[slot.client_id]
            payload = encode_tensors(assignment.tensors)
            payload = shared.setdefault(payload, payload)  # one copy per distinct payload is kept for re-sends
            if payload not in manifests:
                manifests[payload] = self.link.prepare(
                    payload, run=self.rundir.run_id, round=round_, kind=ASSIGNMENT_KIND
                )
                norms[payload] = squared_norms(assignment.tensors)
            self.gate.sent(slot.client_id, norms[payload])
            transfer = self.link.send_payload(slot.client_id, payload, manifests[payload])
            device = self.devices[slot.client_id].device
            seed = round_seed(self.rundir.seed, round_, sorted(self.devices).index(slot.client_id))
            message = Assignment(
                run=self.rundir.run_id,
                round=round_,
                deadline_s=max(1.0, self.open.deadline - time.monotonic()),
                download=transfer,
                spec=assignment.spec,
                train=self.fleet.training.for_device(device, seed),
            )
            self.link.send_control(slot.client_id, message)
            self._assigned[slot.client_id] = (payload, manifests[payload], message, time.monotonic())

    def _close(self, round_: int, pushed: float) -> None:
        assert self.open is not None
        open_ = self.open
        closing = time.monotonic()
        skipped = len(open_.accepted) < self._quorum() and self.fleet.on_quorum_miss == "skip"
        if skipped:
            log.warning(
                "round %d skipped: %d/%d updates, quorum %d",
                round_,
                len(open_.accepted),
                len(open_.participants),
                self._quorum(),
            )
            for participant in open_.participants.values():
                if participant.status == "accepted":
                    participant.status, participant.error = "late", "round skipped: quorum not met"
        else:
            self.strategy.close_round(open_.aggregate)
        aggregated = time.monotonic()
        acc: float | None = None
        loss: float | None = None
        if self.fleet.evaluation.server:
            calibration = self.data.train_x[: self.settings.calibration_samples]
            acc, loss = evaluate_global(self.strategy, (self.data.test_x, self.data.test_y), calibration)
        evaluated = time.monotonic()
        devices = {d: self._device_metrics(d, p) for d, p in open_.participants.items()}
        phases = {
            **open_.phases,
            "train": closing - pushed,
            "aggregate": aggregated - closing,
            "evaluate": evaluated - aggregated,
        }
        metrics = round_metrics(
            round_,
            devices,
            (p.received for p in open_.participants.values() if p.status == "accepted"),
            None if acc is None or loss is None else (acc, loss),
            evaluated - open_.started,
            phases,
        )
        self.rundir.complete_round(round_, self.strategy.state_dict(), metrics)
        self.last = metrics
        (self.rundir.path / OPEN_ROUND_FILE).unlink(missing_ok=True)
        self.open = None
        log.info(
            "round %d closed: %s%s%s, %d/%d updates, %.1f s",
            round_,
            "no server evaluation" if acc is None else f"accuracy {acc:.4f}, loss {loss:.4f}",
            ""
            if metrics.federated_accuracy is None
            else f", federated accuracy {metrics.federated_accuracy:.4f} (model received)",
            "" if metrics.personalized_accuracy is None else f", local accuracy {metrics.personalized_accuracy:.4f}",
            metrics.participants,
            len(devices),
            self.last.seconds,
        )

    def _device_metrics(self, device: str, participant: Participant) -> DeviceRoundMetrics:
        status: DeviceStatus
        if participant.status in ("accepted", "rejected", "failed", "late"):
            status = participant.status  # type: ignore[assignment]
        else:
            status = "late" if self.devices[device].online else "dropped"
        return DeviceRoundMetrics(
            device_class=self.devices[device].device.profile,
            ratio=participant.level if participant.trained_level is None else participant.trained_level,
            bytes_up=self.link.bytes_up(device) - participant.bytes_up_start,
            bytes_down=self.link.bytes_down(device) - participant.bytes_down_start,
            payload_bytes=participant.payload_bytes,
            train_seconds=participant.train_seconds,
            host_seconds=participant.host_seconds,
            status=status,
            error=participant.error,
            local_accuracy=participant.local_accuracy if status == "accepted" else None,
            **received_metrics(participant.received if status == "accepted" else None),
        )

    # ---- events --------------------------------------------------------------------------------

    def _on_message(self, device: str, message: Message) -> None:
        state = self.devices.get(device)
        if state is None:
            log.warning("message from %r, which is not in the fleet; ignored", device)
            return
        if isinstance(message, Hello):
            if message.device != device:
                self._refuse_message(device, f"a hello as {message.device!r}")
                return
            problem = profile_problem(message.profile)
            if problem is not None:
                log.warning("%s sent a hello with %s; ignored (bad_message)", device, problem)
                self._count_refusal(device, "bad_message")
                return
            state.profile = self.reports.adopt(device, message.profile, self.catalog.get(state.device.profile))
            log.info(
                "%s: hello from agent %s (%s, %.2f GFLOPS measured)",
                device,
                message.agent_version,
                message.profile.accelerator,
                message.profile.compute.fp32_gflops,
            )
            note = release_note(message.agent_version)
            if note is not None and state.agent_version != message.agent_version:
                log.warning("%s: %s", device, note)
            state.agent_version, state.refused = message.agent_version, None
            self._set_online(state, True, "hello")
        elif isinstance(message, Status):
            if message.device != device:
                self._refuse_message(device, f"a status naming {message.device!r}")
                return
            state.state = message.state
            self._set_online(state, message.state != "offline", f"{message.state} {printable(message.detail)}".strip())
            if message.state in ("idle", "online"):
                self._resend_assignment(device)
            else:
                self._resend_due.pop(device, None)
        elif isinstance(message, RoundFailed):
            self._on_failed(device, message)
        elif isinstance(message, Error) and message.code == INCOMPATIBLE:
            if state.refused != message.detail:
                log.warning("%s: refused: %s", device, message.detail)
            state.refused = message.detail
            self._set_online(state, False, "incompatible")
        elif isinstance(message, Error):
            log.warning("%s reports: %s: %s", device, message.code, printable(message.detail))

    def _refuse_message(self, device: str, what: str) -> None:
        """A message whose content contradicts its topic's device (the broker-authenticated sender)."""
        log.warning("%s sent %s; ignored (wrong_sender)", device, what)
        self._count_refusal(device, "wrong_sender")

    def _count_refusal(self, device: str, reason: str) -> None:
        self.refusals[(device, reason)] += 1

    def _on_transport_refusal(self, device: str, reason: str) -> None:
        """A transfer the link refused outright (past ``limits``) is the participant's refused upload.

        Without this the device, told its transfer was refused, reports idle, is sent its assignment
        again and retrains the same too-large update until the deadline; as a refusal it is retried once.
        """
        self._count_refusal(device, reason)
        participant = self.open.participants.get(device) if self.open is not None else None
        if reason == "transfer_refused" and participant is not None and participant.status == "assigned":
            participant.status, participant.error = "rejected", "its upload was refused by the link (transfer_refused)"
            participant.rejected_at = time.monotonic()

    def _resend_assignment(self, device: str) -> None:
        """A participant that says it is idle mid-round without an accepted update gets its assignment again.

        It missed it (offline, or another connection with its login took it), or its upload was refused:
        either way it may still train this round. After a refusal, once.
        """
        open_ = self.open
        sent = self._assigned.get(device)
        participant = open_.participants.get(device) if open_ is not None else None
        if open_ is None or sent is None or participant is None:
            return
        if participant.status != "assigned" and (participant.status != "rejected" or participant.retried):
            return
        payload, manifest, assignment, at = sent
        now = time.monotonic()
        if now - at < self.settings.resend_after_s:
            self._resend_due[device] = at + self.settings.resend_after_s
            return
        self._resend_due.pop(device, None)
        if now >= open_.deadline or self.link.payload_in_flight(device):
            return  # a slow download still under way: the device is idle until its assignment message follows
        transfer = self.link.send_payload(device, payload, manifest)
        again = assignment.model_copy(update={"download": transfer, "deadline_s": max(1.0, open_.deadline - now)})
        self.link.send_control(device, again)
        self._assigned[device] = (payload, manifest, again, now)
        if participant.status == "rejected":  # expected to answer again: the refusal grace no longer applies
            participant.status, participant.retried = "assigned", True
        log.info("round %d: %s is idle without an update; its assignment was sent again", open_.round, device)

    def _resend_due_assignments(self) -> None:
        now = time.monotonic()
        for device in [d for d, due in self._resend_due.items() if due <= now]:
            self._resend_assignment(device)

    @staticmethod
    def _set_online(state: DeviceState, online: bool, why: str) -> None:
        if online != state.online:
            log.info("%s: %s (%s)", state.device.id, "online" if online else "offline", why)
        state.online = online

    def _on_failed(self, device: str, failure: RoundFailed) -> None:
        open_ = self.open
        if open_ is None or failure.run != self.rundir.run_id or failure.round != open_.round:
            return
        participant = open_.participants.get(device)
        if participant is None or participant.status == "accepted":
            return
        participant.status, participant.error = "failed", f"{failure.reason}: {printable(failure.detail, 480)}"
        log.warning("round %d: %s failed: %s", open_.round, device, participant.error)
        if failure.reason == "out_of_memory":
            self.step_downs[device] += 1
            self.ceilings = after_out_of_memory(self.ceilings, device, participant.level, self.fleet.ratios)
        elif failure.reason == "state_lost":
            self.strategy.forget(device)
            log.warning("round %d: %s lost its kept state; it gets a whole model next round", open_.round, device)
        elif failure.reason == "bad_assignment":
            log.error(
                "round %d: %s refused its assignment as not fitting the model its spec builds: a strategy bug, "
                "or a coordinator and agent of different releases",
                open_.round,
                device,
            )

    def _on_payload(self, device: str, completed: Completed) -> None:
        manifest = completed.manifest
        if device not in self.devices:
            log.warning("payload from %r, which is not in the fleet; ignored", device)
            return
        if self.open is None and manifest.round == self.next_round and manifest.run == self.rundir.run_id:
            # An update for the round about to (re)open, e.g. right after a coordinator restart: keep it.
            self._deferred.append((device, completed))
            return
        try:
            status = self._accept(device, completed)
        except (UpdateRejected, UploadMetaError, CodecError) as exc:
            reason = refusal_reason(exc)
            log.warning("rejected %s's update for round %d (%s): %s", device, manifest.round, reason, exc)
            self._count_refusal(device, reason)
            self.recent_refusals.append(Refusal(device, manifest.round, reason, str(exc)[:300], time.time()))
            participant = self.open.participants.get(device) if self.open else None
            if participant is not None and participant.status != "accepted":
                # Not an answer yet: the device may still send a valid update this round (see OpenRound.answered).
                participant.status, participant.error = "rejected", str(exc)[:500]
                participant.rejected_at = time.monotonic()
            self.link.send_control(device, Error(code="rejected", detail=str(exc)[:1000], transfer=manifest.transfer))
            return
        self.link.send_control(
            device, Receipt(run=manifest.run, round=manifest.round, transfer=manifest.transfer, status=status)
        )

    def _accept(self, device: str, completed: Completed) -> str:
        """The upload gate: returns the receipt status, or raises why the update is refused.

        Signature -> envelope -> meta -> decode -> declared extras -> the strategy's checks -> journal -> fold.
        The aggregate is touched last, so a refused, duplicate or late upload never counts.
        """
        manifest = completed.manifest
        data = completed.data
        if manifest.kind != UPDATE_KIND:
            raise UploadRefused("wrong_kind", f"expected a transfer of kind {UPDATE_KIND!r}, got {manifest.kind!r}")
        if self.signatures is not None:  # before any receipt: a forgery is refused, never told "duplicate"
            self.signatures.check(device, manifest, data)
        if manifest.run != self.rundir.run_id:
            raise UploadRefused("wrong_run", f"update for run {manifest.run!r}, but this run is {self.rundir.run_id!r}")
        open_ = self.open
        if open_ is None or manifest.round < open_.round:
            if manifest.round < self.next_round:
                return "late"
            raise UploadRefused("wrong_round", f"round {manifest.round} is not open")
        if manifest.round != open_.round:
            raise UploadRefused("wrong_round", f"round {manifest.round} is not open (the open round is {open_.round})")
        participant = open_.participants.get(device)
        if participant is None:
            raise UploadRefused("not_participant", f"{device!r} is not a participant of round {open_.round}")
        if participant.status == "accepted":
            return "duplicate"
        parsed = self.gate.meta(manifest.meta, self.fleet.samples_for(self.devices[device].device))
        try:
            tensors = decode_tensors(data)
            check_dtypes(tensors)
            upload, extras = split_upload(tensors)
            check_extras(extras, self.strategy.declared_extras())
            open_.aggregate.check(device, upload, parsed.samples, extras)
            norm = self.gate.norm(device, participant.level, upload)
        except (UpdateRejected, CodecError):
            raise
        except Exception as exc:  # one device's bytes must never stop the engine, whatever they trip over
            raise UploadRefused("other", f"the update could not be checked: {type(exc).__name__}: {exc}") from exc
        meta = {
            "samples": parsed.samples,
            "train_seconds": parsed.train_seconds,
            "host_seconds": parsed.host_seconds,
            "loss": parsed.loss,
            "level": participant.level,
            "payload_bytes": len(data),
            "local_accuracy": parsed.local_accuracy,
            "received": None if parsed.received is None else asdict(parsed.received),
        }
        try:
            self.rundir.accept_upload(open_.round, device, manifest.transfer, data, meta)
        except RoundNotOpen:
            return "late"
        open_.aggregate.fold(device, upload, parsed.samples, extras)
        self.gate.accepted(participant.level, norm)
        participant.status, participant.payload_bytes = "accepted", len(data)
        participant.train_seconds, participant.local_accuracy = parsed.train_seconds, parsed.local_accuracy
        participant.host_seconds, participant.received = parsed.host_seconds, parsed.received
        return "accepted"
