"""The device agent: one process that joins a fleet and trains whatever rounds it is assigned.

Its port to the coordinator (:mod:`device_agent.agent.port`, the MQTT session on a real device)
runs its own threads and hands every message and verified payload to the agent's event queue; one
main thread does all the work (training included) in order, so the agent's state needs no locks.
The protocol it speaks is described in :mod:`device_agent.wire.protocol`.

What survives what:

- broker restart or network loss: the session reconnects and resumes unfinished transfers;
- agent restart (kill -9, reboot): updates still in the outbox are re-sent at start-up;
- coordinator restart: it re-sends the open round's assignments; an update for that round still
  in the outbox is re-sent instead of training again;
- a refused upload (the coordinator's ``Error`` naming its transfer: the upload gate, or a coordinator of
  another run): the update is dropped and the round counts as not done, so an assignment for it that comes
  now (the coordinator sends one after a refusal; a resumed run re-sends its open round) is trained again.
  Any other repeat of an assignment already trained is ignored;
- personalized strategies: what the program keeps between rounds is on disk (:mod:`device_agent.agent.kept`);
  if it is gone anyway (state directory wiped), the agent answers the round with ``RoundFailed(state_lost)``
  and the coordinator starts it over with a whole model;
- a payload that does not fit the model the assignment's spec builds (names, shapes, dtypes, finite values):
  the agent answers ``RoundFailed(bad_assignment)`` naming the offending tensors, and takes the next round;
- anything else a round raises (a program's bug, out of memory, unreadable data): ``RoundFailed`` with
  the exception's type and message (:func:`device_agent.training.driver.run_assignment`), and the next round.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

from torch import Tensor

from device_agent import __version__
from device_agent.agent.config import AgentConfig
from device_agent.agent.hooks import HooksFor, RuntimeHooks
from device_agent.agent.kept import KeptStore
from device_agent.agent.lock import AlreadyRunning, claim_device, hold
from device_agent.agent.outbox import Outbox, OutboxCorrupt, OutboxItem
from device_agent.agent.port import CoordinatorPort, Signer, Upload
from device_agent.agent.ports import port_kind_of
from device_agent.agent.probe import resolve_device
from device_agent.agent.secure import MASKED_KIND, SecureRounds
from device_agent.agent.signing import UploadIdentity, signed_meta
from device_agent.agent.speed import measured_profile
from device_agent.agent.stopping import stop_on_signals
from device_agent.common.profile import DeviceProfile
from device_agent.data.datasets import DatasetError, check_source, load_dataset
from device_agent.data.partition import capped, client_shard
from device_agent.training.driver import RoundFailure, run_assignment
from device_agent.training.local_round import TrainedRound
from device_agent.training.progress import Pace, TrainingProgress
from device_agent.wire.codec import decode_tensors
from device_agent.wire.messages import (
    INCOMPATIBLE,
    Assignment,
    Error,
    Hello,
    Message,
    Receipt,
    SecAgg,
    Status,
    refuses_version,
)
from device_agent.wire.protocol import UPDATE_KIND, upload_meta
from device_agent.wire.transfer import new_transfer_id

log = logging.getLogger("fedfleet.agent")

RECEIPT_TIMEOUT_S = 30.0
ACKED_RECEIPT_TIMEOUT_S = 120.0
"""How long an update whose transfer the coordinator acked waits for its receipt before it is sent again."""
IDLE_POLL_S = 5.0
"""Longest an agent with nothing to do sleeps before it checks its connection and receipts (messages wake it at
once, its heartbeat is kept to the second). A worker hosts hundreds of agents: a poll every second each cost its
process more than the devices' own messages."""


class AgentError(RuntimeError):
    """The agent cannot start (bad credentials, unreachable broker, unreadable data)."""


@dataclass
class SentUpdate:
    """An outbox update on the wire, waiting for the coordinator's receipt."""

    item: OutboxItem
    transfer: str
    upload: Upload
    since: float
    resends: int = 0
    """How many times this update was sent again before: each waits twice as long for its receipt."""

    def due(self, now: float) -> bool:
        """Whether to send it again: its transfer failed (not refused), or no receipt came in time."""
        if self.upload.error is not None:
            return not self.upload.refused  # a refusal also comes as an Error message, which settles it
        # Acked, the coordinator holds the bytes and a busy one answers late; one that restarts assigns the open
        # round again, which sends the stored update at once. Sending it again sooner only adds to its load.
        timeout = ACKED_RECEIPT_TIMEOUT_S if self.upload.done else RECEIPT_TIMEOUT_S
        return now - self.since > timeout * 2**self.resends


Split = tuple[Tensor, Tensor]


class DeviceData(Protocol):
    """Where an agent's data comes from: its files (:class:`LocalData`), or tensors a simulation holds."""

    samples: int | None
    """At most this many training samples (None: the whole share); what the agent says it trains on."""

    def for_model(self, image_size: int, in_channels: int, num_classes: int) -> tuple[Split, Split]:
        """The (train, test) shards, shaped for a model of this input and classes."""
        ...


class LocalData:
    """This device's (train, test) data, loaded once per model input shape.

    The test shard is the same share of the test split (same partition and label permutation), so it
    follows the training shard's distribution: what a personalized model is measured on.
    """

    def __init__(self, config: AgentConfig) -> None:
        self._config = config.data
        self.samples = config.data.samples
        self._cache: dict[tuple[int, int, int], tuple[Split, Split]] = {}

    def for_model(self, image_size: int, in_channels: int, num_classes: int) -> tuple[Split, Split]:
        key = (image_size, in_channels, num_classes)
        if key not in self._cache:
            data = load_dataset(self._config.source, image_size, in_channels)
            spec = self._config.partition_spec()
            if spec is None:
                train, test = (data.train_x, data.train_y), (data.test_x, data.test_y)
            else:
                index = self._config.index or 0
                train = client_shard(data.train_x, data.train_y, spec, index, data.num_classes)
                test = client_shard(data.test_x, data.test_y, spec, index, data.num_classes)
            if len(train[1]) == 0:
                raise DatasetError(f"data share {self._config.index} of {self._config.count} is empty")
            seed = self._config.seed
            train, test = capped(train, self._config.samples, seed), capped(test, self._config.test_samples, seed)
            self._cache[key] = (train, test)
        return self._cache[key]


class Agent:
    """One device in one fleet. ``run`` blocks until :meth:`stop` (or SIGINT/SIGTERM in ``run_agent``)."""

    def __init__(
        self,
        config: AgentConfig,
        profile: DeviceProfile | None = None,
        hooks: RuntimeHooks | HooksFor | None = None,
        port: CoordinatorPort | None = None,
        data: DeviceData | None = None,
    ) -> None:
        """``hooks`` (or a function of the torch device that makes them) shape this device; none on real hardware.

        The runtime never imports emulation: ``device-agent run`` and the worker inject the emulated
        device's hooks, a test its own. ``port`` defaults to the one ``config.transport.kind`` makes
        (:mod:`device_agent.agent.ports`; ``mqtt``: the MQTT session on ``config.broker``), ``data`` to the
        files ``config.data`` names.
        """
        self.config = config
        self.device = resolve_device(config.device_type)
        self.hooks = hooks(self.device) if callable(hooks) else (hooks or RuntimeHooks())
        state = Path(config.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        self.profile = self.hooks.profile(profile or measured_profile(config.device_type, state))
        self.outbox = Outbox(state / "outbox")
        self.signing_key = config.resolve_signing_key()
        self.kept = KeptStore(state / "kept")
        self.data: DeviceData = data or LocalData(config)
        self._events: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._stopping = threading.Event()
        self._assignments: dict[str, Assignment] = {}
        self._payloads: dict[str, bytes] = {}
        self._done: set[tuple[str, int]] = set()
        self._pace = Pace()
        self._sent: dict[tuple[str, int], SentUpdate] = {}
        self._state = "idle"
        self._said = 0.0
        """When the last status went out (``time.monotonic()``)."""
        self._connects = 0
        self.port = port or port_kind_of(config).port(config, self.hooks.before_chunk_out, self.hooks.after_chunk_in)
        self.secure = SecureRounds(config.device, self.signing_key, self.port.publish, self._send_masked)

    # ---- lifecycle -----------------------------------------------------------------------------

    def run(self, connect_timeout: float | None = None) -> None:
        """Connect and serve until stopped; the session keeps reconnecting on its own.

        Raises :class:`AgentError` when the broker refuses the login, at start-up or on a later
        reconnect: retrying with credentials the broker refused cannot succeed; and when the first
        connection has not succeeded ``connect_timeout`` s after the start (a TLS handshake that fails).
        """
        try:
            self.port.start(
                on_message=lambda message: self._events.put(lambda: self._on_message(message)),
                on_payload=lambda transfer, payload: self._events.put(lambda: self._on_payload(transfer, payload)),
                timeout=connect_timeout,
            )
        except ConnectionError as exc:
            raise AgentError(str(exc)) from None
        log.info("%s: connecting to fleet %s at %s", self.config.device, self.config.fleet, self.port.where)
        beat = self.config.heartbeat_s
        try:
            while not self._stopping.is_set():
                fatal = self.port.fatal()
                if fatal is not None:
                    raise AgentError(fatal)
                try:
                    event = self._events.get(timeout=max(0.0, min(IDLE_POLL_S, self._said + beat - time.monotonic())))
                except queue.Empty:
                    event = None
                if event is not None:
                    event()
                    event = None  # nothing it captured (a payload) outlives it
                now = time.monotonic()
                if self.port.connects != self._connects:
                    self._connects = self.port.connects
                    self._on_connected()
                elif now - self._said >= beat:
                    self._set_state(self._state)
                self._check_receipts(now)
        finally:
            self.port.stop()

    def stop(self) -> None:
        self._stopping.set()
        self._events.put(lambda: None)  # wakes the loop now, not at its next poll

    def _on_connected(self) -> None:
        # Retained: a coordinator that (re)subscribes later still learns who is in the fleet.
        self.port.publish(Hello(device=self.config.device, agent_version=__version__, profile=self.profile), True)
        self._set_state(self._state)
        for item in self.outbox.pending():
            if (item.run, item.round) not in self._sent:
                self._send(item)

    def _set_state(self, state: str, detail: str = "") -> None:
        """Publish the device's state; any status is a heartbeat, so a busy device sends no extra one."""
        self._state, self._said = state, time.monotonic()
        self.port.publish(Status(device=self.config.device, state=state, detail=detail), retain=True)

    # ---- messages ------------------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        if isinstance(message, Assignment):
            self._on_assignment(message)
        elif isinstance(message, Receipt):
            self._forget(message.run, message.round, f"receipt: {message.status}")
        elif isinstance(message, SecAgg):
            self.secure.on_message(message)
        elif isinstance(message, Error) and message.code == INCOMPATIBLE:
            if refuses_version(message):  # the coordinator cannot read what this agent sends
                raise AgentError(f"the coordinator cannot work with this agent: {message.detail}")
            # An answer to a wrong-version message this agent did not send (another client with its login),
            # or this agent's own answer to one it received: neither says the coordinator cannot read it.
            log.warning("%s: ignored, not about this agent's protocol: %r", self.config.device, message.detail[:200])
        elif isinstance(message, Error):
            log.warning("%s: coordinator refused something: %s: %s", self.config.device, message.code, message.detail)
            for key, sent in list(self._sent.items()):
                if sent.transfer == message.transfer:
                    # Refused (by the gate, or by a coordinator of another run): the round is not done. The
                    # assignment for it sent from now on (the same round re-sent, or a resumed run's) is trained.
                    self._done.discard(key)
                    self._forget(*key, f"rejected: {message.detail}")

    def _on_assignment(self, assignment: Assignment) -> None:
        key = (assignment.run, assignment.round)
        self._drop_older(assignment)
        stored = [item for item in self.outbox.pending() if (item.run, item.round) == key]
        if stored:
            # A restarted coordinator re-assigns the open round: send what was trained, do not retrain.
            self._send(stored[0])
            return
        if key in self._done:
            return
        self._assignments[assignment.download] = assignment
        self._try_train(assignment.download)

    def _drop_older(self, assignment: Assignment) -> None:
        """A newer round of the run has begun, so older ones are closed: their updates would only be answered
        late, and sending them would slow this round's transfers (the device's own and, fleet-wide, everyone's)."""
        for item in self.outbox.pending():
            if item.run == assignment.run and item.round < assignment.round:
                sent = self._sent.pop((item.run, item.round), None)
                if sent is not None:
                    self.port.cancel(sent.transfer)
                self.outbox.discard(item)
                log.info(
                    "%s: round %d update dropped: round %d has begun", self.config.device, item.round, assignment.round
                )

    def _on_payload(self, transfer: str, payload: bytes) -> None:
        self._payloads[transfer] = payload
        # Trained as its own event: this one (and its reference to the payload) is gone by then (see _try_train).
        self._events.put(lambda: self._try_train(transfer))

    # ---- one round -----------------------------------------------------------------------------

    def _try_train(self, transfer: str) -> None:
        assignment = self._assignments.get(transfer)
        if assignment is None or transfer not in self._payloads:
            if assignment is not None:
                self._set_state("downloading", f"round {assignment.round}")
            return
        del self._assignments[transfer]
        self._done.add((assignment.run, assignment.round))
        # Drop payloads of assignments that never came (superseded rounds) so memory stays bounded.
        for other in [t for t in self._payloads if t != transfer]:
            del self._payloads[other]
        share = "its whole data share" if self.data.samples is None else f"at most {self.data.samples} samples"
        log.info(
            "%s: round %d: training at level %g on %s, %d epoch(s) of batch %d, deadline %.0f s, %s",
            self.config.device,
            assignment.round,
            assignment.spec.level,
            share,
            assignment.train.epochs,
            assignment.train.batch_size,
            assignment.deadline_s,
            self._pace.expect(assignment.spec.level, assignment.train.epochs, assignment.deadline_s),
        )
        self._set_state("training", f"round {assignment.round} at level {assignment.spec.level:g}")
        # The payload goes to run_assignment as its only reference, which frees it once decoded.
        progress = TrainingProgress(self.config.device, assignment.round, assignment.deadline_s)
        secure = self.secure.expects(assignment.run, assignment.round)
        sent = decode_tensors(self._payloads[transfer]) if secure else None  # what the masked update is taken from
        outcome = run_assignment(
            assignment, self._payloads.pop(transfer), self._shards, self.kept, self.device, self.hooks, progress
        )
        if isinstance(outcome, RoundFailure):
            self._fail(assignment, outcome)
        elif sent is not None:  # under secure aggregation the update leaves masked, never plain (no outbox)
            vector = self.secure.vector(assignment.run, assignment.round, sent, outcome.upload)
            self.secure.trained(assignment.run, assignment.round, vector)
            # Not idle: the update is still to go (masked once the neighbours' shares are here); no re-assignment.
            self._set_state("uploading", f"round {assignment.round}, masked")
        else:
            self._send(self._store(assignment, outcome))

    def _shards(self, assignment: Assignment) -> tuple[Split, Split]:
        model = assignment.spec.model
        return self.data.for_model(model.image_size, model.in_channels, model.num_classes)

    def _store(self, assignment: Assignment, trained: TrainedRound) -> OutboxItem:
        """Put the trained update in the outbox, where it survives until the coordinator's receipt."""
        result, local_accuracy = trained.result, trained.local_accuracy
        seconds = result.seconds + self.hooks.after_training()
        self._pace.record(assignment.spec.level, assignment.train.epochs, seconds)
        held = self.hooks.held_seconds()
        host = max(0.0, seconds - held) if self.config.emulation is not None else None
        meta = upload_meta(result.samples, seconds, result.mean_loss, local_accuracy, host, trained.received)
        item = self.outbox.put(assignment.run, assignment.round, new_transfer_id(), trained.upload, meta)
        log.info(
            "%s: round %d trained on %d samples in %.1f s (loss %.3f, local accuracy %s), update of %d bytes",
            self.config.device,
            assignment.round,
            result.samples,
            seconds,
            result.mean_loss,
            "n/a" if local_accuracy is None else f"{local_accuracy:.3f}",
            item.size,
        )
        return item

    def _fail(self, assignment: Assignment, failure: RoundFailure) -> None:
        log.warning("%s: round %d failed: %s: %s", self.config.device, assignment.round, failure.reason, failure.detail)
        self.port.publish(failure.to_message(assignment))
        self._set_state("idle", f"round {assignment.round} failed: {failure.reason}")

    def _send(self, item: OutboxItem, resends: int = 0) -> None:
        try:
            payload = self.outbox.payload(item)
        except OutboxCorrupt as exc:
            log.error("%s: dropping a corrupt stored update: %s", self.config.device, exc)
            self.outbox.discard(item)
            return
        self.hooks.before_upload()
        self._set_state("uploading", f"round {item.round}")
        transfer = new_transfer_id()
        upload = self.port.send(
            payload,
            self._signer(item, transfer),
            run=item.run,
            round=item.round,
            kind=UPDATE_KIND,
            meta=dict(item.meta),
            transfer=transfer,
        )
        self._sent[(item.run, item.round)] = SentUpdate(item, transfer, upload, time.monotonic(), resends)

    def _send_masked(self, run: str, round_: int, masked: bytes) -> None:
        self.port.send(masked, None, run=run, round=round_, kind=MASKED_KIND, transfer=new_transfer_id())

    def _signer(self, item: OutboxItem, transfer: str) -> Signer | None:
        """Signs an upload's meta over the digest of the transfer as sent; None when this device does not sign."""
        key = self.signing_key
        if key is None:
            return None
        identity = partial(UploadIdentity, self.config.fleet, item.run, item.round, self.config.device, transfer)
        return lambda digest, meta: signed_meta(meta, key, identity(digest))

    def _forget(self, run: str, round_: int, why: str) -> None:
        sent = self._sent.pop((run, round_), None)
        for item in self.outbox.pending():
            if (item.run, item.round) == (run, round_):
                self.outbox.discard(item)
                log.info("%s: round %d update settled (%s)", self.config.device, round_, why)
        if sent is not None and not self._sent:
            self._set_state("idle")

    def _check_receipts(self, now: float) -> None:
        """Resend an update whose transfer failed, or that got no receipt in time (a coordinator restart)."""
        for key, sent in list(self._sent.items()):
            if sent.due(now):
                if key not in {(i.run, i.round) for i in self.outbox.pending()}:
                    del self._sent[key]
                    continue
                log.info(
                    "%s: re-sending the round %d update (%s)",
                    self.config.device,
                    key[1],
                    sent.upload.error or "no receipt",
                )
                self._send(sent.item, sent.resends + 1)


def run_agent(config: AgentConfig, profile: DeviceProfile | None = None, hooks: HooksFor | None = None) -> int:
    """Run until SIGINT/SIGTERM; the exit code of ``device-agent run``.

    Holds the state directory's lock and the device's claim on this machine (``device_agent.agent.lock``)
    throughout: a second agent with the same login would take over this one's broker session. Before it
    connects, the port kind's preflight waits for the way to the coordinator (``mqtt``: the broker's TCP port).
    """
    kind = port_kind_of(config)  # an unknown transport.kind is refused before anything is held or loaded
    try:
        check_source(config.data.source)
    except DatasetError as exc:
        raise AgentError(str(exc)) from None
    try:
        lock = hold(Path(config.state_dir))
    except AlreadyRunning as exc:
        raise AgentError(str(exc)) from None
    try:
        claim = claim_device(kind.claim_key(config), config.state_dir)
    except AlreadyRunning as exc:
        lock.close()
        raise AgentError(str(exc)) from None
    with lock, claim or nullcontext():
        agent = Agent(config, profile, hooks)  # first: a setting of this device (no CUDA...) fails before any waiting
        started = time.monotonic()
        try:
            kind.preflight(config, config.connect_timeout_s)
        except ConnectionError as exc:
            raise AgentError(str(exc)) from None
        stop_on_signals(agent.stop)
        # The rest of the budget for the connection itself: a TLS handshake that fails is not retried forever.
        agent.run(connect_timeout=max(1.0, config.connect_timeout_s - (time.monotonic() - started)))
    return 0


__all__ = ["Agent", "AgentError", "DeviceData", "LocalData", "run_agent"]
