"""Run any strategy for N rounds on in-process clients, through the same round engine as a fleet.

``simulate`` builds a small fleet (one device per client, fixed levels), a throwaway run
directory and a :class:`~coordinator.transport.memory_link.MemoryLink` (one real agent per client, over
memory), and runs :class:`~coordinator.rounds.engine.RoundEngine` on them: the same planning hook, upload
gate, journal, seeding, static BN and evaluation as ``coordinator start`` (see
:mod:`coordinator.rounds.evaluation`), the same device runtime as a fleet's, with every payload encoded and
decoded as on the wire. Only the transport and the planner differ: clients keep the level they are given.

Per round it reports the global accuracy (None with ``server_evaluation=False``: a coordinator with
no data), the federated accuracy (the devices' evaluation of the model they received, on their test
shards), the personalized accuracy (the mean of what each device measures for its trained model on
its own test shard) and the bytes of each client's upload as it
travelled (safetensors, header included). This is what the comparison harness and the unit tests
use.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from torch import Tensor

from coordinator.config.fleet import Fleet, parse_fleet
from coordinator.planning.planner import DevicePlan
from coordinator.rounds.async_engine import engine_class
from coordinator.rounds.engine import EngineSettings
from coordinator.run.metrics import failed_rounds
from coordinator.run.rundir import RunDir
from coordinator.strategies.base import ClientSlot, Strategy
from coordinator.transport.link import Link
from coordinator.transport.memory_link import LocalDevice
from coordinator.transport.registry import transport_of, transport_problems
from device_agent.clients.spec import TrainConfig
from device_agent.common.profile import DeviceProfile
from device_agent.data.datasets import LabeledData
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.simulation")

Split = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class SimClient:
    client_id: str
    level: float
    train: Split
    test: Split

    @property
    def slot(self) -> ClientSlot:
        return ClientSlot(self.client_id, self.level, len(self.train[1]))


@dataclass(frozen=True)
class RoundRecord:
    round: int
    upload_bytes: dict[str, int]
    seconds: float
    accuracy: float | None
    personalized_accuracy: float | None = None
    federated_accuracy: float | None = None
    epsilon: float | None = None
    """With ``privacy``: epsilon at the fleet's delta after this round."""


@dataclass
class SimulationResult:
    rounds: list[RoundRecord] = field(default_factory=list)
    failed_rounds: list[int] = field(default_factory=list)
    """Rounds that aggregated no update or fewer than the quorum (:func:`coordinator.run.metrics.failed_rounds`)."""

    @property
    def final(self) -> RoundRecord:
        return self.rounds[-1]

    @property
    def upload_bytes_per_round(self) -> float:
        """Mean bytes one client uploads in one round."""
        sizes = [b for record in self.rounds for b in record.upload_bytes.values()]
        return sum(sizes) / len(sizes) if sizes else 0.0


def tensor_bytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def fixed_levels(levels: Mapping[str, float]):
    """A planner that gives every device the level it was created with."""

    def plan(
        fleet: Fleet,
        _catalog: Mapping[str, DeviceClass],
        _reports: Mapping[str, DeviceProfile],
        _ceilings: Mapping[str, float],
    ) -> list[DevicePlan]:
        return [
            DevicePlan(
                device=d.id,
                profile="simulated",
                ratio=levels[d.id],
                model=None,
                trainable_params=None,
                est_memory_bytes=None,
                memory_budget_bytes=None,
                est_round_seconds=None,
                deadline_seconds=fleet.round_deadline_s,
                reason="fixed by the simulation",
            )
            for d in fleet.devices
        ]

    return plan


def simulation_fleet(
    strategy: Strategy,
    clients: Sequence[SimClient],
    rounds: int,
    train: TrainConfig,
    server_evaluation: bool = True,
    limits: Mapping[str, object] | None = None,
    participation: float = 1.0,
    privacy: Mapping[str, object] | None = None,
    quorum: float = 1.0,
    transport: str = "in_process",
    secure_aggregation: Mapping[str, object] | None = None,
    asynchronous: Mapping[str, object] | None = None,
) -> dict:
    """The fleet.yaml of a simulation: one device per client, every training option from ``train``,
    fleet.yaml's ``limits`` from ``limits`` (the upload gate's bounds); ``participation`` < 1 asks that
    fraction of the clients each round (a large fleet's partial rounds); ``quorum`` is the share of a round's
    devices it must aggregate not to count as failed (below 1 where some are expected to be refused);
    ``transport`` the registered transport whose in-memory devices run it; ``secure_aggregation`` fleet.yaml's
    section of that name; ``asynchronous`` fleet.yaml's ``strategy.async`` (FedBuff, ``mode: async``: ``rounds``
    counts model versions)."""
    model = strategy.model
    training = {
        "optimizer": train.optimizer,
        "lr": train.lr,
        "weight_decay": train.weight_decay,
        "local_epochs": train.epochs,
        "batch_size": train.batch_size,
        "mask_absent_classes": train.mask_absent_classes,
        "absent_class_fill": train.absent_class_fill,
    }
    if train.optimizer == "momentum":
        training["momentum"] = train.momentum
    return {
        "fleet": "simulation",
        "transport": {"kind": transport},
        "model": {
            "arch": model.arch,
            "num_classes": model.num_classes,
            "in_channels": model.in_channels,
            "image_size": model.image_size,
        },
        "dataset": {"name": "digits", "seed": train.seed},
        "strategy": {
            "name": strategy.name,
            **(
                {"params": strategy.params.model_dump(mode="json")}
                if privacy or secure_aggregation or asynchronous is not None
                else {}
            ),
            **({"mode": "async", "async": dict(asynchronous)} if asynchronous is not None else {}),
        },
        "ratios": sorted({c.level for c in clients}, reverse=True),
        "rounds": rounds,
        "participation": participation,
        "round_deadline_s": 86400,
        "quorum": quorum,
        "training": training,
        "evaluation": {"server": server_evaluation},
        "devices": [
            {"id": c.client_id, "profile": "simulated", "overrides": {"samples": len(c.train[1])}} for c in clients
        ],
        **({"limits": dict(limits)} if limits else {}),
        **({"privacy": dict(privacy)} if privacy else {}),
        **({"secure_aggregation": dict(secure_aggregation)} if secure_aggregation else {}),
    }


def simulate(
    strategy: Strategy,
    clients: Sequence[SimClient],
    rounds: int,
    train: TrainConfig,
    test: Split,
    calibration: Tensor,
    server_evaluation: bool = True,
    link: Link | None = None,
    limits: Mapping[str, object] | None = None,
    participation: float = 1.0,
    privacy: Mapping[str, object] | None = None,
    quorum: float = 1.0,
    transport: str = "in_process",
    secure_aggregation: Mapping[str, object] | None = None,
    run_dir: Path | None = None,
    batch: bool = False,
    asynchronous: Mapping[str, object] | None = None,
) -> SimulationResult:
    """Run ``rounds`` rounds of ``strategy`` over ``clients``; ``train.seed`` seeds the run.

    ``server_evaluation=False`` runs as a coordinator without data: ``test`` and ``calibration`` go unused.
    ``transport`` names the registered transport (:mod:`coordinator.transport.registry`) whose
    :meth:`~coordinator.transport.registry.Transport.simulation_link` carries the clients (``in_process``: real
    agents over memory); ``link`` replaces it with a Link of devices named by the clients' ids. ``limits`` and
    ``privacy`` are fleet.yaml's sections of those names (validated the same way), e.g. the update bound,
    or DP-FedAvg's clipping and noise. ``quorum``: see :func:`simulation_fleet` (a round with its quorum
    still waits for the rest within the laggards' grace). ``secure_aggregation``: fleet.yaml's section (SecAgg+,
    FedAvg only, with ``limits`` that screen nothing). ``run_dir``: where the run directory goes (kept for the
    caller to read), else a temporary one. ``batch``: the clients train at once, their steps of one model, level
    and batch shape batched (:mod:`device_agent.emulation.batching`; uploads still reach the engine in the order
    it assigned them), so the same seeds give the same model to float rounding rather than bit for bit; the
    ``in_process`` transport's option. ``asynchronous``: fleet.yaml's ``strategy.async`` section: FedBuff
    (:class:`~coordinator.rounds.async_engine.AsyncEngine`) instead of rounds, ``rounds`` model versions, each
    reported as a round.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not clients:
        raise ValueError("a simulation needs at least one client")
    raw = simulation_fleet(
        strategy,
        clients,
        rounds,
        train,
        server_evaluation,
        limits,
        participation,
        privacy,
        quorum,
        transport,
        secure_aggregation,
        asynchronous,
    )
    fleet = parse_fleet(raw, source="simulation")
    if link is None:
        problems = transport_problems(fleet, simulation=True)
        if problems:
            raise ValueError("; ".join(problems))
        devices = [LocalDevice(c.client_id, c.train, c.test) for c in clients]
        link = transport_of(fleet).simulation_link(fleet, devices, **({"batch": True} if batch else {}))
    data = LabeledData(
        calibration, calibration.new_zeros(len(calibration)), test[0], test[1], strategy.model.num_classes
    )
    with tempfile.TemporaryDirectory(prefix="fedfleet-simulation-") as tmp:
        fleet_file = Path(tmp) / "fleet.yaml"
        fleet_file.write_text(yaml.safe_dump(raw))
        rundir = RunDir.create(run_dir or Path(tmp) / "run", fleet_file, strategy.state_dict(), seed=train.seed)
        try:
            engine = engine_class(fleet)(
                fleet,
                {},
                strategy,
                rundir,
                data,
                link,
                EngineSettings(
                    min_devices=len(clients),
                    wait_timeout_s=60,
                    calibration_samples=len(calibration),
                    gate=fleet.limits.gate(),
                    rejected_grace_s=0.0,  # a refused client is not waited for: its agent would train it again
                ),
                planner=fixed_levels({c.client_id: c.level for c in clients}),
            )
            engine.run()
            metrics = rundir.metrics()
            failed = failed_rounds(metrics, fleet.quorum)
            if failed:
                log.warning("simulation: rounds %s failed (no update, or below the quorum)", failed)
        finally:
            rundir.close()
    return SimulationResult(
        [
            RoundRecord(
                m.round,
                {d: row.payload_bytes for d, row in m.devices.items() if row.status == "accepted"},
                m.seconds,
                m.accuracy,
                m.personalized_accuracy,
                m.federated_accuracy,
                None if m.privacy is None else m.privacy.epsilon,
            )
            for m in metrics
        ],
        failed,
    )


__all__ = ["RoundRecord", "SimClient", "SimulationResult", "fixed_levels", "simulate", "tensor_bytes"]
