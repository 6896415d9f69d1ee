"""An :class:`AsyncEngine` over real in-memory agents on iid digits, for the async engine's and observers' tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.async_engine import AsyncEngine, engine_class
from coordinator.rounds.engine import EngineSettings
from coordinator.rounds.signing import UploadSignatures
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)


def async_engine(
    tmp_path: Path,
    names: list[str],
    versions: int,
    settings: dict,
    levels=None,
    link: type[MemoryLink] = MemoryLink,
    signatures: UploadSignatures | None = None,
) -> AsyncEngine:
    """An AsyncEngine over one real agent per name (in memory, on ``link``), FedAvg on iid digits."""
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(names, levels)
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, versions, TrainConfig(batch_size=32), asynchronous=settings)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(raw))
    calibration = data.train_x[:128]
    fleet = parse_fleet(raw)
    engine = engine_class(fleet)(
        fleet,
        {},
        strategy,
        RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0),
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        link([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
        EngineSettings(min_devices=len(names), wait_timeout_s=60, calibration_samples=128),
        planner=fixed_levels({c.client_id: c.level for c in clients}),
        signatures=signatures,
    )
    assert isinstance(engine, AsyncEngine)
    return engine
