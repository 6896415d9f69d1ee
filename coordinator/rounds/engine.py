"""The round engine: any strategy's rounds over any :class:`~coordinator.transport.link.Link`, durable across restarts.

One thread owns every piece of round state. The link's threads only enqueue events (hello, status, uploads,
failures; a message with its arrival time) and the engine's loop applies them in order, so validation, journaling,
folding and answering an upload happen as one step and need no locks. One round core for MQTT
(``coordinator start``) and for in-process devices (the simulation, ``benchmarks.compare``).

The loop is here; its parts are one module each: who is online and what they measured
(:mod:`~coordinator.rounds.roster`), who trains this round (:mod:`~coordinator.rounds.draw`),
assignments and their re-send policy (:mod:`~coordinator.rounds.dispatch`), the upload gate
(:mod:`~coordinator.rounds.admission`) and round closing (:mod:`~coordinator.rounds.closing`).

Durability: the round's participants and levels are saved in the run directory before any
assignment leaves, every accepted upload is journaled before it is folded and before its receipt
is sent, and closing a round is ``RunDir.complete_round``'s atomic commit. A restart on the same
run directory reloads the last global state, re-opens the same round with the same participants,
folds the journal back in and re-sends the assignments; devices that already trained re-send
their stored update instead of training again. Personalized strategies: the global model is only a reference;
see ``personalized_accuracy``.
"""

from __future__ import annotations

import logging
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.fleet import Fleet
from coordinator.planning.planner import plan_fleet, why_no_one
from coordinator.privacy.layer import private_strategy
from coordinator.rounds.admission import Admission
from coordinator.rounds.closing import RoundCloser, log_closed, retry_round
from coordinator.rounds.dispatch import Dispatcher
from coordinator.rounds.draw import ParticipantDraw, Planner
from coordinator.rounds.failures import round_failed
from coordinator.rounds.laggards import LaggardGrace
from coordinator.rounds.roster import Roster
from coordinator.rounds.secure import SecureRound
from coordinator.rounds.secure_layouts import secure_layout
from coordinator.rounds.settings import EngineSettings
from coordinator.rounds.signing import UploadSignatures
from coordinator.rounds.state import (
    DeviceState,
    OpenRound,
    Participant,
    Refusal,
    Refusals,
    printable,
    refusal_reason,
)
from coordinator.rounds.upload_gate import UploadGate, UploadRefused
from coordinator.run.metrics import PrivacyMetrics
from coordinator.run.rundir import RunDir
from coordinator.strategies import ClientSlot, Strategy
from coordinator.transport.link import Link
from device_agent.agent.secure import MASKED_KIND
from device_agent.data.datasets import LabeledData
from device_agent.secagg import ParameterError, Session
from device_agent.secagg.auth import HmacAuth
from device_agent.wire.codec import CodecError
from device_agent.wire.messages import INCOMPATIBLE, Error, Hello, Message, Receipt, RoundFailed, SecAgg, Status
from device_agent.wire.payload import Received
from device_agent.wire.protocol import UploadMetaError
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.engine")

TICK_S = 0.25  # the longest the loop applies events before it looks at the round again


class RoundEngine:
    """Runs ``fleet.rounds`` rounds of ``strategy`` over ``link`` and records them in ``rundir``."""

    runs_async = False
    """Async mode (``strategy.mode: async``) is :class:`~coordinator.rounds.async_engine.AsyncEngine`'s."""

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
        if (fleet.strategy.mode == "async") != self.runs_async:
            engine = "AsyncEngine" if fleet.strategy.mode == "async" else "RoundEngine"
            raise ValueError(f"strategy.mode: {fleet.strategy.mode} runs on {engine} (async_engine.engine_class)")
        settings = self.settings_for(settings)
        self.fleet = fleet
        self.privacy = (
            None
            if fleet.privacy is None
            else private_strategy(strategy, fleet.privacy, len(fleet.devices), fleet.participation, fleet.rounds)
        )
        self.strategy: Strategy = strategy if self.privacy is None else self.privacy
        self.budget_exhausted: str | None = None
        """Why the run stopped before its last round: the next round would have passed ``privacy`` budget."""
        self.rundir = rundir
        self.link = link
        self.settings = settings
        self.refused = Refusals()
        self.roster = Roster(fleet, catalog, self.refused)
        self.devices = self.roster.devices
        self.draw = ParticipantDraw(fleet, planner, rundir)
        # The direction checks compare updates layer by layer: only where their layers align.
        unaligned = replace(settings.gate, direction_min_cosine=None, peer_min_cosine=None, update_noise=None)
        if self.privacy is not None:  # checks that compare devices with each other are outside the accountant
            unaligned = replace(unaligned, update_bound_factor=None)  # and the privacy layer adds its own noise
        gate = UploadGate(settings.gate if self.strategy.aligned_updates else unaligned)
        expected = lambda d: fleet.samples_for(self.devices[d].device)  # noqa: E731
        contract = self.strategy.upload_contract
        typical = statistics.median(fleet.samples_for(d) for d in fleet.devices) if fleet.devices else None
        self.admission = Admission(
            gate, rundir, expected, signatures, self.refused, contract=contract, typical_samples=typical
        )
        self.dispatch = Dispatcher(link, self.strategy, gate, rundir, fleet, settings.resend_after_s)
        self.laggards = LaggardGrace(settings.laggard_grace_factor, settings.laggard_grace_min_s)
        self.closer = RoundCloser(
            self.strategy, fleet, data, link, self.roster, settings.calibration_samples, gate.noise_std
        )
        self.open: OpenRound | None = None
        self.secure: SecureRound | None = None
        """The open round's secure aggregation (fleet.yaml ``secure_aggregation``), None without it."""
        self._secure_auth = None if signatures is None else HmacAuth(signatures.keys)
        self.last = None
        self.stopping = threading.Event()
        self._events: queue.Queue[Callable[[], None]] = queue.Queue()
        self._deferred: list[tuple[str, Received]] = []
        window = rundir.saved_norm_history()
        if window is not None:
            gate.history.restore(window, rundir.saved_norm_peaks())
        records = rundir.saved_peer_records()
        if records is not None:
            gate.records.restore(records)
        self._resume()

    @classmethod
    def settings_for(cls, settings: EngineSettings) -> EngineSettings:
        """The settings this engine runs under: rounds run ``settings`` as given (a subclass may turn off what
        its mode cannot do)."""
        return settings

    def _resume(self) -> None:
        """Go on where the last process on the run directory stopped: its last committed state, the open round
        and that round's journal (folded back in when the round re-opens)."""
        resume = self.rundir.resume()
        self.strategy.load_state_dict(resume.state)
        self.next_round = resume.next_round
        self._journal = resume.journal

    # What observers (status page, Prometheus, live table) read.
    refusals = property(lambda self: self.refused.counts)
    recent_refusals = property(lambda self: self.refused.recent)
    step_downs = property(lambda self: self.draw.step_downs)
    backoff = property(lambda self: self.draw.backoff)
    plans = property(lambda self: self.draw.plans)

    def run(self, progress: Callable[[RoundEngine], None] = lambda _e: None) -> bool:
        """Run until every round is done (True) or :meth:`stop` (False). The link is stopped on return."""
        self._listen()
        try:
            if not self._wait_for_devices(progress):
                return False
            while self.next_round <= self.fleet.rounds and not self.stopping.is_set():
                if not self._run_round(self.next_round, progress):
                    return False
                self.next_round += 1
            return self.next_round > self.fleet.rounds  # a stop between two rounds is a stop, not the end
        finally:
            self.link.stop()

    def stop(self) -> None:
        self.stopping.set()

    def _listen(self) -> None:
        """Start the link: its threads only queue what arrives, for the loop to apply in order."""
        self.link.start(
            on_message=lambda device, m: self._events.put(partial(self._on_message, device, m, time.monotonic())),
            on_payload=lambda device, c: self._events.put(lambda: self._on_payload(device, c)),
            on_refused=lambda device, reason: self._events.put(lambda: self._on_transport_refusal(device, reason)),
        )

    def _pump(self, until: float, progress: Callable[[RoundEngine], None]) -> None:
        """Apply events for one tick at most, never past ``until``: no flood holds a round open past its deadline."""
        until = min(until, time.monotonic() + TICK_S)
        while not self.stopping.is_set():
            try:
                self._events.get(timeout=max(0.0, until - time.monotonic()))()
            except queue.Empty:
                break
            if time.monotonic() >= until:
                break
        progress(self)

    def _drain(self) -> None:
        """Apply every event already queued: a hello during closing counts before the next draw."""
        while True:
            try:
                self._events.get_nowait()()
            except queue.Empty:
                return

    def _wait_for_devices(self, progress: Callable[[RoundEngine], None]) -> bool:
        """Until ``min_devices`` are online, and then the rest of the fleet or ``settle_s``, whichever comes first."""
        give_up = time.monotonic() + self.settings.wait_timeout_s
        settled: float | None = None
        while not self.stopping.is_set():
            online = len(self.roster.online())
            if self._journal and online:
                return True
            if online >= self.settings.min_devices:
                settled = settled or time.monotonic() + self.settings.settle_s
                if online >= len(self.devices) or time.monotonic() >= settled:
                    return True
                self._pump(min(settled, time.monotonic() + 0.1), progress)
                continue
            if time.monotonic() > give_up:
                offline = ", ".join(d for d, s in self.devices.items() if not s.online)
                raise TimeoutError(
                    f"only {online} of the {self.settings.min_devices} devices needed came online "
                    f"within {self.settings.wait_timeout_s:.0f} s (offline: {offline}; a device that never "
                    "comes online may have the wrong fleet name, broker URL or password: `device-agent doctor`)"
                )
            self._pump(time.monotonic() + 0.5, progress)
        return False

    def _run_round(self, round_: int, progress: Callable[[RoundEngine], None]) -> bool:
        started = time.monotonic()
        self._drain()
        participants = self.draw.draw(round_, self.roster)
        if not participants and not self.stopping.is_set():
            why = why_no_one(self.plans, set(self.roster.online()))
            wait = self.settings.wait_timeout_s
            log.warning("round %d: no online device can take part (%s); waiting up to %.0f s", round_, why, wait)
        while not participants and not self.stopping.is_set():
            if time.monotonic() - started > self.settings.wait_timeout_s:
                raise TimeoutError(
                    f"round {round_}: no device could take part within {self.settings.wait_timeout_s:.0f} s"
                )
            self._pump(time.monotonic() + 1.0, progress)
            participants = self.draw.draw(round_, self.roster)
        if self.stopping.is_set():
            return False
        population = self._population(round_, len(participants))
        if self._over_budget(round_, population, len(participants)):
            return False
        slots = [ClientSlot(d, level, self.fleet.samples_for(self.devices[d].device)) for d, level in participants]
        self.rundir.save_participants(round_, dict(participants), population)
        aggregate = self.strategy.open_round(round_, slots)
        self.admission.gate.open_round()
        self.dispatch.clear()
        deadline = started + self.fleet.round_deadline_s
        self.open = OpenRound(
            round_, {d: Participant(level) for d, level in participants}, aggregate, deadline, started
        )
        self.admission.replay(
            self._journal,
            self.open,
            lambda: self.strategy.open_round(round_, slots),
            lambda: {d: a.tensors for d, a in self.strategy.configure(round_, slots).items()},
        )
        self._journal = []
        # A secure round's bytes start with its key exchange (the dispatcher counts from the assignment on).
        counted = {d: (self.link.bytes_up(d), self.link.bytes_down(d)) for d in self.open.participants}
        if self.fleet.secure_aggregation is not None:
            if not self._exchange_keys(round_, slots, progress):
                return False
            members = frozenset() if self.secure is None else self.secure.members
            slots = [slot for slot in slots if slot.client_id in members]
        planned = time.monotonic()
        self.dispatch.push(self.open, slots, self.roster)
        if self.secure is not None:
            for device, (up, down) in counted.items():
                self.open.participants[device].bytes_up_start = up
                self.open.participants[device].bytes_down_start = down
        pushed = time.monotonic()
        deferred, self._deferred = self._deferred, []
        for device, received in deferred:
            self._on_payload(device, received)
        self.open.phases.update(plan=planned - started, push=pushed - planned)
        self.open.pushed = pushed
        if self.secure is not None:
            self._await_secure_sum(progress)
        else:
            self._await_answers(progress)
        if self.stopping.is_set():
            return False
        self.link.close_round(round_)
        self.admission.screen_round(self.open, lambda: self.strategy.open_round(round_, slots))
        self.last = self.closer.close(self.open, self._quorum(), pushed)
        if self.secure is not None and self.secure.result is not None:
            self.last = self.last.model_copy(update={"secure": self.secure.metrics()})
        if self.privacy is not None:  # every drawn device counts, answered or not
            release = self.privacy.charge(population, len(participants))
            self.last = self.last.model_copy(update={"privacy": PrivacyMetrics(**vars(release))})
            log.info(
                "round %d: user-level epsilon %.3f at delta %g (%d of %d devices drawn), next clip norm %.4g",
                round_,
                release.epsilon,
                release.delta,
                len(participants),
                population,
                release.clip_norm,
            )
        gate = self.admission.gate
        self.rundir.save_norm_history(round_, gate.history.window(), gate.records.state(), gate.history.peaks())
        self.rundir.complete_round(round_, self.strategy.state_dict(), self.last)
        self.open, self.secure = None, None
        log_closed(self.last, self.fleet.quorum)
        self.draw.backoff.record(self.last)
        progress(self)
        return True

    def _exchange_keys(self, round_: int, slots: list[ClientSlot], progress: Callable[[RoundEngine], None]) -> bool:
        """Secure aggregation's key exchange, before any assignment: who does not take part in it is left out."""
        open_, settings = self.open, self.fleet.secure_aggregation
        assert open_ is not None and settings is not None
        assignments = {d: a.tensors for d, a in self.strategy.configure(round_, slots).items()}
        layout = secure_layout(self.strategy, round_, slots, assignments, settings)
        # A new attempt on every (re)opening of the round: a resumed round never reuses a mask.
        session = Session(self.fleet.fleet, self.rundir.run_id, round_, attempt=time.time_ns())
        devices = [slot.client_id for slot in slots]
        try:
            self.secure = SecureRound(settings, session, devices, layout, self.link, self._secure_auth)
        except ParameterError as exc:  # too few devices drawn for the threshold: this round fails, the run goes on
            why = f"secure_aggregation does not fit the {len(slots)} devices drawn: {exc}"
            log.warning("round %d: %s", round_, why)
            for participant in open_.participants.values():
                participant.status, participant.reason, participant.error = "failed", "secure_aggregation", why
            return True
        self.secure.start()
        while not self.secure.keys_exchanged and not self.stopping.is_set():
            self._pump(self.secure.stage_deadline, progress)
            self.secure.tick(open_.deadline, [d for d in open_.participants if not self.devices[d].online])
        why = self.secure.error or "did not take part in the secure-aggregation key exchange"
        for device, participant in open_.participants.items():
            if device not in self.secure.members:
                participant.status, participant.reason, participant.error = "failed", "secure_aggregation", why
        return not self.stopping.is_set()

    def _await_secure_sum(self, progress: Callable[[RoundEngine], None]) -> None:
        """Until the survivors' sum is unmasked (or the protocol stopped), then fold it into the round."""
        open_, secure = self.open, self.secure
        assert open_ is not None and secure is not None
        while not secure.finished and not self.stopping.is_set():
            self._pump(open_.deadline if secure.masking else secure.stage_deadline, progress)
            gone = [d for d, p in open_.participants.items() if p.status == "failed" or not self.devices[d].online]
            if self._secure_retry_due(secure, gone):
                secure = self._retry_secure(secure, gone)
                continue
            secure.tick(open_.deadline, gone)
        if secure.result is not None:
            secure.fold_into(open_.aggregate, open_)
            return
        for participant in open_.participants.values():
            if participant.status != "failed":
                participant.status, participant.reason = "failed", "secure_aggregation"
                participant.error = secure.error or "the coordinator stopped"

    def _left_secure_round(self, device: str) -> None:
        """A device that goes offline owing its masked input has left the round's protocol for good.

        Its protocol keys lived in its process: a new process of it holds none and could not mask. So the masking
        stage does not wait for it to come back, and it is not sent its assignment again (it would train a round it
        cannot mask); its masks come off with its neighbours' shares. It takes part again from the next round.
        """
        open_, secure = self.open, self.secure
        participant = open_.participants.get(device) if open_ is not None else None
        if open_ is None or secure is None or participant is None or participant.status != "assigned":
            return
        if secure.owes_masked_input(device):
            participant.status, participant.reason = "failed", "secure_aggregation"
            participant.error = "went offline before its masked input: its protocol keys are gone with it"
            log.info("round %d: %s left secure aggregation (offline before its masked input)", open_.round, device)

    def _secure_retry_due(self, secure: SecureRound, gone: list[str]) -> bool:
        """``on_quorum_miss: retry`` under SecAgg: the masked inputs fall below the quorum as their stage closes.

        Decided before unmasking, never after: a second sum over a superset of one already unmasked would give
        the coordinator the difference, one device's update if one device more came in."""
        open_ = self.open
        assert open_ is not None
        if not secure.masking or self.fleet.on_quorum_miss != "retry" or open_.retries >= self.fleet.quorum_retries:
            return False
        closing = time.monotonic() >= open_.deadline or not secure.server.pending() - set(gone)
        masked = len(secure.server.members - secure.server.pending())
        return closing and masked < self._quorum()

    def _retry_secure(self, secure: SecureRound, gone: list[str]) -> SecureRound:
        """The protocol again as a new attempt (fresh keys and masks) among the participants still there: who
        trained masks its kept update again, who trains still (or is re-sent its assignment) masks when done."""
        open_, settings = self.open, self.fleet.secure_aggregation
        assert open_ is not None and settings is not None
        open_.retries += 1
        open_.deadline = time.monotonic() + self.fleet.round_deadline_s
        devices = [d for d in open_.participants if d not in gone]
        session = replace(secure.session, attempt=time.time_ns())
        log.warning(
            "round %d: %d masked inputs, below the quorum of %d; secure aggregation again with fresh keys among %d "
            "devices (retry %d of %d)",
            open_.round,
            len(secure.server.members - secure.server.pending()),
            self._quorum(),
            len(devices),
            open_.retries,
            self.fleet.quorum_retries,
        )
        try:
            retried = SecureRound(settings, session, devices, secure.layout, self.link, self._secure_auth)
        except ParameterError as exc:  # too few left for the threshold: this attempt goes on to its end
            log.warning("round %d: no retry: %s", open_.round, exc)
            open_.retries = self.fleet.quorum_retries
            return secure
        self.secure = retried
        retried.start()
        return retried

    def _population(self, round_: int, drawn: int) -> int:
        """The devices a round's participants were drawn from: this draw's, or the saved one of a resumed round."""
        if self.rundir.saved_participants(round_) is None:
            return self.draw.population
        return self.rundir.saved_population(round_) or drawn  # unknown: as if every device was drawn (q = 1)

    def _over_budget(self, round_: int, population: int, drawn: int) -> bool:
        """True (and why, in ``budget_exhausted``) when round ``round_`` would take epsilon past the budget."""
        budget = None if self.privacy is None else self.privacy.settings.budget
        if self.privacy is None or budget is None:
            return False
        after = self.privacy.ledger.epsilon_with(self.privacy.round_charge(population, drawn))
        if after <= budget:
            return False
        spent = self.privacy.ledger.epsilon()
        self.budget_exhausted = (
            f"privacy budget: round {round_} would take epsilon from {spent:.3f} to {after:.3f} at delta "
            f"{self.privacy.settings.delta:g}, past the budget {budget:g}; the run stops after round {round_ - 1}"
        )
        log.warning("%s", self.budget_exhausted)
        return True

    def _await_answers(self, progress: Callable[[RoundEngine], None]) -> None:
        """Until every participant answered, the laggards' grace, or the deadline (below the quorum: extended once,
        or retried up to ``quorum_retries`` times, as ``on_quorum_miss`` says)."""
        open_ = self.open
        assert open_ is not None
        while not self.stopping.is_set():
            self._pump(open_.deadline, progress)
            self.dispatch.resend_due(open_)
            if open_.answered(self.devices, time.monotonic() - self.settings.rejected_grace_s):
                return
            estimates = {d: plan.est_round_seconds for d, plan in self.plans.items()}
            if self.laggards.past(open_, self._quorum(), time.monotonic(), estimates):
                return
            if time.monotonic() < open_.deadline:
                continue
            if len(open_.accepted) >= self._quorum() or self.fleet.on_quorum_miss == "skip":
                return
            if self.fleet.on_quorum_miss == "retry":
                if open_.retries >= self.fleet.quorum_retries:
                    return
                open_.retries += 1
                open_.deadline = time.monotonic() + self.fleet.round_deadline_s
                retry_round(open_, self.dispatch.retry(open_, set(self.roster.online())), self._quorum(), self.fleet)
                continue
            if open_.extended:
                return
            open_.extended = True
            open_.deadline += self.fleet.round_deadline_s
            log.warning(
                "round %d: %d/%d updates at the deadline, below the quorum of %d; extending once by %.0f s",
                open_.round,
                len(open_.accepted),
                len(open_.participants),
                self._quorum(),
                self.fleet.round_deadline_s,
            )

    def _quorum(self) -> int:
        assert self.open is not None
        return max(1, math.ceil(self.fleet.quorum * len(self.open.participants)))

    def _on_message(self, device: str, message: Message, arrived: float | None = None) -> None:
        if device not in self.devices:
            log.warning("message from %r, which is not in the fleet; ignored", device)
            return
        if isinstance(message, Hello):
            self.roster.hello(device, message)
        elif isinstance(message, Status):
            if not self.roster.status(device, message):
                return
            if message.state == "offline":
                self._left_secure_round(device)
            if message.state in ("idle", "online"):
                self.dispatch.resend(device, self.open, arrived)
            else:
                self.dispatch.cancel(device)
        elif isinstance(message, SecAgg):
            if self.secure is not None:
                self.secure.on_message(device, message)
        elif isinstance(message, RoundFailed):
            round_failed(self.open, device, message, self.rundir.run_id, self.draw, self.strategy)
        elif isinstance(message, Error) and message.code == INCOMPATIBLE:
            self.roster.incompatible(device, message.detail)
        elif isinstance(message, Error):
            log.warning("%s reports: %s: %s", device, message.code, printable(message.detail))

    def _on_transport_refusal(self, device: str, reason: str) -> None:
        """A transfer the link refused outright (past ``limits``) is the participant's refused upload.

        As a refusal it is retried once, not retrained and refused again until the deadline.
        """
        self.refused.count(device, reason)
        participant = self.open.participants.get(device) if self.open is not None else None
        if reason == "transfer_refused" and participant is not None and participant.status == "assigned":
            participant.reject(reason, "its upload was refused by the link (transfer_refused)")

    def _on_payload(self, device: str, received: Received) -> None:
        if device not in self.devices:
            log.warning("payload from %r, which is not in the fleet; ignored", device)
            return
        if received.kind == MASKED_KIND:  # never an update: a masked input only counts within the protocol's sum
            if self.secure is not None:
                self.secure.on_masked(device, received)
            return
        if self.fleet.secure_aggregation is not None:  # an update in the clear is never decoded, nor folded
            why = "a plain update under secure_aggregation: updates must come masked (the agent lost its keys?)"
            self.admission.refuse(device, received.round, UploadRefused("wrong_kind", why), self.open)
            self.link.send_control(device, Error(code="rejected", detail=why, transfer=received.transfer))
            return
        if self.open is None and received.round == self.next_round and received.run == self.rundir.run_id:
            # An update for the round about to (re)open, e.g. right after a coordinator restart: keep it.
            self._deferred.append((device, received))
            return
        try:
            status = self.admission.admit(device, received, self.open, self.next_round)
        except (UpdateRejected, UploadMetaError, CodecError) as exc:
            self.admission.refuse(device, received.round, exc, self.open)
            self.link.send_control(device, Error(code="rejected", detail=str(exc)[:1000], transfer=received.transfer))
            return
        self.link.send_control(
            device, Receipt(run=received.run, round=received.round, transfer=received.transfer, status=status)
        )


__all__ = ["DeviceState", "EngineSettings", "OpenRound", "Participant", "Refusal", "RoundEngine", "refusal_reason"]
