"""A round under secure aggregation (fleet.yaml ``secure_aggregation``): the coordinator learns only the sum.

The engine runs :class:`SecureRound` instead of decoding each device's update. Its order, over the Link:

1. keys: every participant gets a ``Setup``, advertises fresh keys and shares its secrets with its neighbours
   (:mod:`device_agent.secagg`); this takes a round trip each and happens before any assignment is sent, while
   the devices are idle, so a device that does not answer is left out before it trains;
2. the survivors of the key exchange get their neighbours' shares and then their assignments; each trains,
   masks its update in the round's layout (:mod:`~coordinator.rounds.secure_layouts`: FedAvg's update, a
   width slice padded into the full model, FedHM's dense update) and sends the masked input as a payload
   (:data:`~device_agent.agent.secure.MASKED_KIND`), folded into one running sum on arrival;
3. at the round's deadline (or once every device sent its masked input), the devices still there return the
   shares that remove the masks, and :meth:`fold_into` hands the strategy's round the sum.

Nothing of one device's update reaches the journal, the metrics or the log: no upload is journaled (a resumed
round runs the protocol again, as a new session ``attempt``, with fresh keys and masks), and the server
protocol keeps only the running masked sum. Each device scales its contribution by a public weight sent with its
setup (FedAvg: its fleet.yaml share over the round's largest; FedHM: its softmax weight) and the sum is divided
by the survivors' weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

import numpy as np

from coordinator.config.secure import SecureAggregation
from coordinator.rounds.secure_layouts import SecureLayout
from coordinator.rounds.state import OpenRound
from coordinator.run.metrics import SecureMetrics
from coordinator.strategies import RoundAggregate
from coordinator.transport.link import Link
from device_agent.agent.secure import CLAMPED_VALUES, unwrap, wrap
from device_agent.secagg import Aggregate, Params, ServerProtocol, Session
from device_agent.secagg.auth import Authenticator
from device_agent.secagg.errors import ProtocolAborted, SecAggError
from device_agent.secagg.messages import decode
from device_agent.secagg.server import ServerStage
from device_agent.wire.messages import SecAgg
from device_agent.wire.payload import Received

log = logging.getLogger("fedfleet.engine")

KEY_EXCHANGE_S = 30.0
"""The longest the key exchange (advertise, share keys) waits per stage before the round's assignments go out."""
UNMASK_GRACE_S = 30.0
"""The longest the unmasking stage waits for the survivors' shares after the masked inputs are in."""


class SecureRound:
    """One round's SecAgg+ run: ``start``, feed it ``on_message`` / ``on_masked``, ``tick`` it, read ``result``."""

    def __init__(
        self,
        settings: SecureAggregation,
        session: Session,
        participants: Sequence[str],
        layout: SecureLayout,
        link: Link,
        auth: Authenticator | None = None,
        stage_s: float = KEY_EXCHANGE_S,
    ) -> None:
        """``layout``: the vector every participant masks (its strategy's, :mod:`~coordinator.rounds.secure_layouts`)
        and the public weights each scales it by; ``stage_s``: the longest a key-exchange stage waits (the
        unmasking stage waits at least as long). Raises ``ParameterError`` when the threshold cannot be met by
        this many participants."""
        self.layout = layout
        # A round that drew fewer devices than fleet.yaml's round size (some offline) may have fewer than
        # `neighbours` + 1: each is then a neighbour of all the others (SecAgg's complete graph), same threshold.
        neighbours = min(settings.neighbours, len(participants) - 1)
        devices = tuple(sorted(participants))
        length = layout.length + CLAMPED_VALUES
        params = Params(devices, settings.threshold, neighbours, length, settings.clip, settings.bits)
        self.server = ServerProtocol(session, params, auth)
        self.session, self.link = session, link
        self.stage_s = stage_s
        self.stage_deadline = time.monotonic() + stage_s
        self.error: str | None = None
        """Why the protocol stopped without a sum (``ProtocolAborted``), or None."""

    @property
    def result(self) -> Aggregate | None:
        return self.server.result

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def keys_exchanged(self) -> bool:
        """Past the key exchange: the members may be sent their assignments."""
        return self.server.stage in (ServerStage.MASK, ServerStage.UNMASK, ServerStage.DONE) or self.error is not None

    @property
    def masking(self) -> bool:
        return self.server.stage is ServerStage.MASK

    def start(self) -> None:
        for setup in self.server.start():
            weight = None if self.layout.weights is None else self.layout.weights[setup.device]
            layout = self.layout.layout(setup.device)
            message = wrap(self.session.run, self.session.round, setup, weight, layout, self.layout.noise)
            self.link.send_control(setup.device, message)

    def on_message(self, device: str, message: SecAgg) -> None:
        """A device's protocol message; one naming another device, or out of turn, is logged and dropped."""
        if (message.run, message.round) != (self.session.run, self.session.round):
            return
        try:
            inner = unwrap(message)
        except SecAggError as exc:
            log.warning("round %d: %s sent a malformed secure-aggregation message: %s", self.session.round, device, exc)
            return
        self._receive(device, inner)

    def on_masked(self, device: str, received: Received) -> None:
        """A device's masked input (a payload); folded into the running sum, never kept alone."""
        if (received.run, received.round) != (self.session.run, self.session.round):
            return
        try:
            inner = decode(received.data)
        except SecAggError as exc:
            log.warning("round %d: %s sent a malformed masked input: %s", self.session.round, device, exc)
            return
        self._receive(device, inner)

    def tick(self, round_deadline: float, gone: Collection[str] = ()) -> None:
        """Close the open stage once no one is pending but the ``gone`` (failed, offline), or at its deadline.

        Who did not answer by then has dropped out of the protocol.
        """
        if self.finished:
            return
        now = time.monotonic()
        deadline = round_deadline if self.masking else self.stage_deadline
        if self.server.pending() - set(gone) and now < deadline:
            return
        try:
            self._send(self.server.advance())
        except ProtocolAborted as exc:
            self.error = str(exc)
            log.warning("round %d: secure aggregation aborted: %s", self.session.round, exc)
            return
        grace = max(UNMASK_GRACE_S, self.stage_s) if self.server.stage is ServerStage.UNMASK else self.stage_s
        self.stage_deadline = time.monotonic() + grace

    def owes_masked_input(self, device: str) -> bool:
        """Whether ``device`` was sent its assignment and its masked input has not arrived yet."""
        return self.server.stage is ServerStage.MASK and device in self.server.pending()

    @property
    def members(self) -> frozenset[str]:
        """The devices still in the protocol."""
        return self.server.members if self.error is None else frozenset()

    def fold_into(self, aggregate: RoundAggregate, open_: OpenRound) -> None:
        """Hand the strategy's round the survivors' sum, as if each had uploaded; they count as accepted."""
        result = self.result
        assert result is not None
        self.layout.fold(aggregate, result.total[: self.layout.length], result.survivors)
        aggregate.received.extend(result.survivors)  # type: ignore[attr-defined]
        now = time.monotonic()
        for device in result.survivors:
            participant = open_.participants[device]
            participant.status, participant.answered_at = "accepted", participant.answered_at or now
        log.info(
            "round %d: secure sum of %d updates (%d dropped), at most %.3g off the exact sum per value",
            self.session.round,
            len(result.survivors),
            len(result.dropped),
            result.error_bound,
        )

    def metrics(self) -> SecureMetrics | None:
        """What the round's sum says about the protocol (None before it was unmasked)."""
        result = self.result
        if result is None:
            return None
        clip, quantizer, m = self.server.params.clip, self.server.params.quantizer, len(result.survivors)
        zero = float(quantizer.decode_sum(quantizer.encode(np.zeros(1)), 1)[0])  # a 0 decodes to half a step
        clamped = (float(result.total[self.layout.length]) - m * zero) / (clip * m)
        return SecureMetrics(
            survivors=len(result.survivors),
            dropped=len(result.dropped),
            error_bound=result.error_bound,
            clamped_fraction=min(1.0, max(0.0, clamped)),
        )

    def _receive(self, device: str, message: object) -> None:
        if getattr(message, "device", None) != device:
            log.warning("round %d: %s sent a secure-aggregation message of another device", self.session.round, device)
            return
        try:
            self.server.receive(message)  # type: ignore[arg-type]
        except SecAggError as exc:
            log.warning("round %d: %s: %s", self.session.round, device, exc)
            return
        if not self.server.pending():
            self.tick(0.0)  # every answer of the stage is in: go on at once

    def _send(self, messages: Sequence[object]) -> None:
        for message in messages:
            self.link.send_control(message.device, wrap(self.session.run, self.session.round, message))  # type: ignore[attr-defined]


__all__ = ["KEY_EXCHANGE_S", "UNMASK_GRACE_S", "SecureRound"]
