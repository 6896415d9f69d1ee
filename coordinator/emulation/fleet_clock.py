"""Rounds and FedBuff on the fleet's own clock: when would the global model reach an accuracy on these devices?

A wall-clock race on one shared host measures the host. Here every device's assignment takes the device time the
planner predicts for it (:func:`~coordinator.planning.planner.plan_fleet`: training steps at its profile's speed
and its level, plus its link's transfer), and the run is a discrete-event simulation on that clock: the host
trains each update for real, as fast as it can, and the clock says when the update would have arrived.

- sync (:func:`run_sync`): a round is sent to every device and closes when its slowest device answers; the
  clock moves by that device's time. Aggregation is the strategy's round (``open_round`` / ``close_round``).
- async (:func:`run_async`): FedBuff (:class:`~coordinator.rounds.fedbuff.FedBuff`): a device is sent the newest
  version as soon as its update is in; updates are folded in arrival order on the clock.

Both train with the device's own code (``train_assignment``, what an agent runs) and evaluate the global model the
way rounds do (:func:`~coordinator.rounds.evaluation.evaluate_global`, static BN on the coordinator's samples) after
each round or published version, so :meth:`ClockRun.time_to_accuracy` is the device time at which the global model
first reached a target accuracy, for sync and async alike. Transfers are charged once per assignment; links are
not shared (no contention at the broker) and devices never fail: the figure compares the two schedules.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.asynchronous import AsyncSettings
from coordinator.config.fleet import Fleet
from coordinator.planning.planner import plan_fleet
from coordinator.rounds.evaluation import evaluate_global
from coordinator.rounds.fedbuff import FedBuff
from coordinator.strategies.base import Assignment, ClientSlot, Strategy
from device_agent.clients.spec import TrainConfig
from device_agent.training.local_round import train_assignment
from device_agent.wire.protocol import round_seed, split_upload
from profiles.schema import DeviceClass

Split = tuple[Tensor, Tensor]
NO_TEST: Split = (torch.zeros(0, 1, 1, 1), torch.zeros(0, dtype=torch.long))
"""Devices evaluate nothing here: only the global model's accuracy is on the clock."""


@dataclass(frozen=True)
class ClockDevice:
    """One device: its data, the level it trains at and the device seconds one assignment takes."""

    device: str
    level: float
    seconds: float
    train: Split

    @property
    def slot(self) -> ClientSlot:
        return ClientSlot(self.device, self.level, len(self.train[1]))


@dataclass(frozen=True)
class Point:
    """The global model's accuracy at ``seconds`` of device time: after ``version`` rounds or versions."""

    seconds: float
    accuracy: float
    version: int
    updates: int
    """Updates folded so far."""


@dataclass
class ClockRun:
    mode: str
    points: list[Point] = field(default_factory=list)
    staleness: Counter[int] = field(default_factory=Counter)
    """Async: staleness -> folded updates."""
    refused: Counter[str] = field(default_factory=Counter)
    """Async: refusal reason (``too_stale``) -> updates."""
    updates_per_version: dict[int, int] = field(default_factory=dict)
    folded: int = 0
    """Updates aggregated in all (async: also those in the buffer when the run stopped)."""

    def time_to_accuracy(self, target: float) -> float | None:
        """Device seconds at which the global model first reached ``target`` (None: it never did)."""
        return next((p.seconds for p in self.points if p.accuracy >= target), None)

    def accuracy_at(self, seconds: float) -> float:
        """The accuracy of the newest global model at ``seconds`` of device time (the initial model's before)."""
        reached = [p.accuracy for p in self.points if p.seconds <= seconds]
        return reached[-1] if reached else self.points[0].accuracy

    @property
    def best(self) -> float:
        return max(p.accuracy for p in self.points)


def planned_devices(fleet: Fleet, catalog: Mapping[str, DeviceClass], data: Mapping[str, Split]) -> list[ClockDevice]:
    """The fleet's devices at the level the planner gives them, each taking the planner's estimate per assignment.

    ``data``: each device's training split by id. A device the planner excludes is left out.
    """
    devices = []
    for plan in plan_fleet(fleet, catalog):
        if plan.ratio is None or plan.est_round_seconds is None:
            continue
        devices.append(ClockDevice(plan.device, plan.ratio, plan.est_round_seconds, data[plan.device]))
    if not devices:
        raise ValueError("the planner left no device in the fleet")
    return devices


def run_sync(
    strategy: Strategy,
    devices: Sequence[ClockDevice],
    train: TrainConfig,
    test: Split,
    calibration: Tensor,
    until_seconds: float,
    stop_at: float | None = None,
) -> ClockRun:
    """Rounds of every device until ``until_seconds`` of device time (or the accuracy ``stop_at``)."""
    run = ClockRun("sync", [Point(0.0, _accuracy(strategy, test, calibration), 0, 0)])
    clock, round_, updates = 0.0, 0, 0
    slots = [d.slot for d in devices]
    order = sorted(d.device for d in devices)
    while clock < until_seconds and not _reached(run, stop_at):
        round_ += 1
        sent = strategy.configure(round_, slots)
        aggregate = strategy.open_round(round_, slots)
        for device in devices:
            seed = round_seed(train.seed, round_, order.index(device.device))
            upload, extras = _trained(sent[device.device], device, train, seed)
            aggregate.add(device.device, upload, len(device.train[1]), extras)
            updates += 1
        strategy.close_round(aggregate)
        clock += max(d.seconds for d in devices)
        run.points.append(Point(clock, _accuracy(strategy, test, calibration), round_, updates))
    run.folded = updates
    return run


def run_async(
    strategy: Strategy,
    settings: AsyncSettings,
    devices: Sequence[ClockDevice],
    train: TrainConfig,
    test: Split,
    calibration: Tensor,
    until_seconds: float,
    stop_at: float | None = None,
) -> ClockRun:
    """FedBuff on the clock until ``until_seconds`` of device time (or the accuracy ``stop_at``)."""
    server = FedBuff(strategy, settings)
    run = ClockRun("async", [Point(0.0, _accuracy(strategy, test, calibration), 0, 0)])
    server.remember()  # the initial model's static BN statistics travel with version 0
    by_id = {d.device: d for d in devices}
    order = sorted(by_id)
    training: list[tuple[float, int, str, int, Assignment]] = []  # (arrives, sequence, device, version, sent)
    idle: list[str] = []
    sequence = 0

    def start(device: str, now: float) -> None:
        nonlocal sequence
        if not server.can_assign():
            idle.append(device)
            return
        version, assignment = server.assign(by_id[device].slot)
        sequence += 1
        heapq.heappush(training, (now + by_id[device].seconds, sequence, device, version, assignment))

    for device in order:
        start(device, 0.0)
    updates = 0
    while training:
        now, count, device_id, version, sent = heapq.heappop(training)
        if now > until_seconds or _reached(run, stop_at):
            break
        device = by_id[device_id]
        seed = round_seed(train.seed, count, order.index(device_id))
        upload, extras = _trained(sent, device, train, seed)
        try:
            server.check(device.slot, version, upload, len(device.train[1]), extras)
        except UpdateRejected as exc:  # too stale: the device's work is lost, it starts over on the newest model
            run.refused[exc.reason] += 1
            server.release(device_id)
        else:
            updates += 1
            published = server.fold(device.slot, version, upload, len(device.train[1]), extras)
            if published is not None:
                accuracy = _accuracy(strategy, test, calibration)
                server.remember()  # static BN changed the model: the version's base and assignments follow
                run.points.append(Point(now, accuracy, published.version, updates))
        for waiting in [idle.pop(0) for _ in range(len(idle))]:
            start(waiting, now)
        start(device_id, now)
    run.staleness = Counter(server.staleness_histogram)
    run.updates_per_version = dict(server.updates_per_version)
    run.folded = updates
    return run


def _trained(
    sent: Assignment, device: ClockDevice, train: TrainConfig, seed: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """What the device uploads after training ``sent`` on its data (the agent's own code)."""
    config = train.model_copy(update={"seed": seed})
    done = train_assignment(sent.spec, config, sent.tensors, None, device.train, NO_TEST)
    return split_upload(done.upload)


def _accuracy(strategy: Strategy, test: Split, calibration: Tensor) -> float:
    return evaluate_global(strategy, test, calibration)[0]


def _reached(run: ClockRun, target: float | None) -> bool:
    return target is not None and run.points[-1].accuracy >= target


def speed_spread(devices: Sequence[ClockDevice]) -> float:
    """Slowest over fastest device seconds per assignment."""
    seconds = [d.seconds for d in devices]
    return max(seconds) / min(seconds) if min(seconds) > 0 else math.inf


__all__ = ["ClockDevice", "ClockRun", "Point", "planned_devices", "run_async", "run_sync", "speed_spread"]
