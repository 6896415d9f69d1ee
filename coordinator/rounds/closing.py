"""Closing a round: aggregate (or skip below quorum), evaluate, and assemble the round's metrics line."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from coordinator.algorithms.robust import noised
from coordinator.config.fleet import Fleet
from coordinator.privacy.noise import RoundNoise
from coordinator.rounds.evaluation import evaluate_global, federated_evaluation, personalized_accuracy
from coordinator.rounds.roster import Roster
from coordinator.rounds.state import OpenRound, Participant
from coordinator.run.metrics import DeviceRoundMetrics, DeviceStatus, RoundMetrics, is_failed, received_metrics
from coordinator.strategies import Strategy
from coordinator.transport.link import Link
from device_agent.clients.base import is_norm_statistic
from device_agent.data.datasets import LabeledData
from device_agent.wire.protocol import ReceivedEvaluation

GLOBAL = "global."
"""The prefix of the global model's weights in the state dict of the strategies the gate screens (FedAvg, FedHM)."""

log = logging.getLogger("fedfleet.engine")


@contextmanager
def every_core() -> Iterator[None]:
    """Torch on all of this host's cores for a while, then as it was.

    A round is evaluated between its close and the next round's push, while the devices wait. An emulating
    coordinator keeps torch to one thread (its cores train the emulated devices), so without this the
    evaluation of Fashion-MNIST's 10,000 test images took 4.1 s on one core with the other idle.
    """
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(threads, cores))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class RoundCloser:
    """Turns an open round into its :class:`RoundMetrics`; the caller commits them with the new state."""

    def __init__(
        self,
        strategy: Strategy,
        fleet: Fleet,
        data: LabeledData,
        link: Link,
        roster: Roster,
        calibration_samples: int,
        noise: Callable[[int], float | None] = lambda _folded: None,
    ) -> None:
        """``noise(k)``: the std per weight of the weak noise on a round's aggregate of k updates, or None (the upload
        gate's :meth:`~coordinator.rounds.upload_gate.UploadGate.noise_std`)."""
        self.noise = noise
        self.strategy = strategy
        self.fleet = fleet
        self.data = data
        self.link = link
        self.roster = roster
        self.calibration_samples = calibration_samples

    def close(self, open_: OpenRound, quorum: int, pushed: float) -> RoundMetrics:
        closing = time.monotonic()
        if len(open_.accepted) < quorum and self.fleet.on_quorum_miss == "skip":
            log.warning(
                "round %d skipped: %d/%d updates, quorum %d",
                open_.round,
                len(open_.accepted),
                len(open_.participants),
                quorum,
            )
            for participant in open_.participants.values():
                if participant.status == "accepted":
                    participant.status, participant.error = "late", "round skipped: quorum not met"
        else:
            self.strategy.close_round(open_.aggregate)
            self._add_noise(len(open_.accepted))
        aggregated = time.monotonic()
        server = self.evaluate()
        evaluated = time.monotonic()
        devices = {d: self.device_metrics(d, p) for d, p in open_.participants.items()}
        phases = {
            **open_.phases,
            "train": closing - pushed,
            "aggregate": aggregated - closing,
            "evaluate": evaluated - aggregated,
        }
        return round_metrics(
            open_.round,
            devices,
            (p.received for p in open_.participants.values() if p.status == "accepted"),
            server,
            evaluated - open_.started,
            phases,
        )

    def evaluate(self) -> tuple[float, float] | None:
        """The new global model's (accuracy, loss) on the test set after static BN on the calibration samples;
        None without ``evaluation.server``."""
        if not self.fleet.evaluation.server:
            return None
        calibration = self.data.train_x[: self.calibration_samples]
        with every_core():
            return evaluate_global(self.strategy, (self.data.test_x, self.data.test_y), calibration)

    def _add_noise(self, folded: int) -> None:
        """The weak noise on the new global weights (not the BatchNorm statistics, which are calibrated apart): the
        privacy layer's generator, one fresh draw per round."""
        std = self.noise(folded)
        if std is None:
            return
        state = self.strategy.state_dict()
        keys = [
            k
            for k, v in state.items()
            if k.startswith(GLOBAL) and v.is_floating_point() and not is_norm_statistic(k.removeprefix(GLOBAL))
        ]
        self.strategy.load_state_dict(noised(state, keys, std, RoundNoise().normal))

    def device_metrics(self, device: str, participant: Participant) -> DeviceRoundMetrics:
        state = self.roster.devices[device]
        status: DeviceStatus
        if participant.status in ("accepted", "rejected", "failed", "late"):
            status = participant.status  # type: ignore[assignment]
        else:
            status = "late" if state.online else "dropped"
        return DeviceRoundMetrics(
            device_class=state.device.profile,
            ratio=participant.level if participant.trained_level is None else participant.trained_level,
            bytes_up=self.link.bytes_up(device) - participant.bytes_up_start,
            bytes_down=self.link.bytes_down(device) - participant.bytes_down_start,
            payload_bytes=participant.payload_bytes,
            train_seconds=participant.train_seconds,
            host_seconds=participant.host_seconds,
            status=status,
            error=participant.error,
            reason=participant.reason if status in ("rejected", "failed") else None,
            local_accuracy=participant.local_accuracy if status == "accepted" else None,
            clipped=participant.clipped if status == "accepted" else None,
            **received_metrics(participant.received if status == "accepted" else None),
        )


def round_metrics(
    round_: int,
    devices: Mapping[str, DeviceRoundMetrics],
    received: Iterable[ReceivedEvaluation | None],
    server: tuple[float, float] | None,
    seconds: float,
    phases: Mapping[str, float],
) -> RoundMetrics:
    """The round's metrics line: ``received`` from the accepted uploads, ``server`` the (accuracy, loss) here.

    It reads only numbers the upload bounds limit (:mod:`device_agent.wire.bounds`), so it cannot fail
    on a journaled upload (``tests/coordinator/rounds/test_round_close.py`` proves it over any accepted meta).
    """
    federated = federated_evaluation(received)
    return RoundMetrics(
        round=round_,
        accuracy=None if server is None else server[0],
        loss=None if server is None else server[1],
        federated_accuracy=None if federated is None else federated[0],
        federated_loss=None if federated is None else federated[1],
        personalized_accuracy=personalized_accuracy(m.local_accuracy for m in devices.values()),
        participants=sum(m.status == "accepted" for m in devices.values()),
        bytes_up=sum(m.bytes_up for m in devices.values()),
        bytes_down=sum(m.bytes_down for m in devices.values()),
        seconds=seconds,
        phases=dict(phases),
        devices=dict(devices),
    )


def log_closed(metrics: RoundMetrics, quorum: float) -> None:
    """The one line a closed round leaves in the coordinator's log: a WARNING that says FAILED below ``quorum``.

    A round without enough accepted updates still closes (its model is the round before's, or barely trained);
    its line must not read like a good round's.
    """
    acc, loss = metrics.accuracy, metrics.loss
    failed = is_failed(metrics, quorum)
    log.log(
        logging.WARNING if failed else logging.INFO,
        "round %d %s: %d/%d updates%s, %s%s%s, %.1f s",
        metrics.round,
        "FAILED" if failed else "closed",
        metrics.participants,
        len(metrics.devices),
        f" (quorum {math.ceil(quorum * len(metrics.devices))}{missing(metrics)})" if failed else "",
        "no server evaluation" if acc is None else f"accuracy {acc:.4f}, loss {loss:.4f}",
        ""
        if metrics.federated_accuracy is None
        else f", federated accuracy {metrics.federated_accuracy:.4f} (model received)",
        "" if metrics.personalized_accuracy is None else f", local accuracy {metrics.personalized_accuracy:.4f}",
        metrics.seconds,
    )


def retry_round(open_: OpenRound, sent_again: list[str], quorum: int, fleet: Fleet) -> None:
    """Say that a round below its quorum at the deadline is retried (``on_quorum_miss: retry``), and how."""
    log.warning(
        "round %d FAILED at its deadline: %d/%d updates (quorum %d); retrying it (%d of %d): %s, waiting %.0f s more",
        open_.round,
        len(open_.accepted),
        len(open_.participants),
        quorum,
        open_.retries,
        fleet.quorum_retries,
        f"assignment sent again to {', '.join(sent_again[:10])}{' ...' if len(sent_again) > 10 else ''}"
        if sent_again
        else "no participant online to send it to",
        fleet.round_deadline_s,
    )


def missing(metrics: RoundMetrics) -> str:
    """Why the updates are missing, by status: ``; 1 late, 1 rejected``."""
    counts = Counter(m.status for m in metrics.devices.values() if m.status != "accepted")
    return "; " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) if counts else ""


__all__ = ["RoundCloser", "log_closed", "retry_round", "round_metrics"]
