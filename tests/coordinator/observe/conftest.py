"""One small in-process run watched by a :class:`FleetWatch`: two devices, one of which sends a NaN loss.

The engine runs behind an :class:`MemoryLink` exactly as ``coordinator.emulation.simulation`` runs it, with the
watch as its progress callback, so the observers see real engine state (refusals included) in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.observe.snapshot import FleetWatch
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.metrics import RoundMetrics
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from tests.coordinator.rounds.test_upload_gate import TamperingLink, nan_loss
from tests.digit_clients import digit_clients

ROUNDS = 2


@dataclass
class WatchedRun:
    watch: FleetWatch
    engine: RoundEngine
    metrics: list[RoundMetrics]


@pytest.fixture(scope="package")
def watched_run(tmp_path_factory: pytest.TempPathFactory) -> WatchedRun:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["bad", "good"], levels=[1.0, 0.5])
    strategy = build_strategy("fedhm", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    raw = simulation_fleet(strategy, clients, ROUNDS, TrainConfig(batch_size=32))
    tmp = tmp_path_factory.mktemp("watched")
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(raw))
    rundir = RunDir.create(Path(tmp) / "run", tmp / "fleet.yaml", strategy.state_dict(), seed=0)
    calibration = data.train_x[:256]
    engine = RoundEngine(
        parse_fleet(raw, source="test"),
        {},
        strategy,
        rundir,
        LabeledData(calibration, calibration.new_zeros(len(calibration)), data.test_x, data.test_y, 10),
        TamperingLink([LocalDevice(c.client_id, c.train, c.test) for c in clients], nan_loss),
        # No re-send after the refusal: "bad" would train its round again and be refused twice in that round
        # whenever "good" trains longer than resend_after_s (a loaded host), and the counts below are exact.
        EngineSettings(
            min_devices=2,
            wait_timeout_s=60,
            calibration_samples=len(calibration),
            rejected_grace_s=0.5,
            resend_after_s=3600,
        ),
        planner=fixed_levels({c.client_id: c.level for c in clients}),
    )
    watch = FleetWatch(rundir.metrics())
    try:
        assert engine.run(watch.update)
        return WatchedRun(watch, engine, rundir.metrics())
    finally:
        rundir.close()
