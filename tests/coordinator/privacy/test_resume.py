"""A resumed private run restores its ledger exactly and goes on charging the draw it really makes."""

from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.privacy.accountant import RoundCharge, epsilon
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)
Z, DELTA = 1.5, 1e-3
PRIVACY = {"noise_multiplier": Z, "delta": DELTA, "clip": {"mode": "adaptive", "initial": 0.2}}


def engine_for(raw: dict, rundir: RunDir, clients) -> RoundEngine:
    data = load_dataset("digits", 8, 1)
    return RoundEngine(
        parse_fleet(raw, source="test"),
        {},
        build_strategy("fedhm", CNN, {"weighting": "uniform"}, seed=0),
        rundir,
        data,
        MemoryLink([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
        EngineSettings(min_devices=len(clients), wait_timeout_s=60, calibration_samples=128),
        planner=fixed_levels({c.client_id: c.level for c in clients}),
    )


@pytest.mark.slow
def test_a_resumed_run_restores_the_ledger_and_the_clip_norm_exactly(tmp_path: Path) -> None:
    clients = digit_clients([f"pi-{i}" for i in range(4)], [1.0, 0.5, 1.0, 0.5])
    strategy = build_strategy("fedhm", CNN, {"weighting": "uniform"}, seed=0)
    raw = simulation_fleet(strategy, clients, 2, TrainConfig(batch_size=32), participation=0.5, privacy=PRIVACY)
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    first = engine_for(raw, RunDir.create(run_dir, fleet_file, strategy.state_dict(), seed=0), clients)
    assert first.run()
    first.rundir.close()
    charges, clip = list(first.privacy.ledger.charges), first.privacy.clip_norm
    assert charges == [RoundCharge(4, 2, Z / 2)] * 2  # 2 of 4 devices drawn without replacement each round

    again = engine_for({**raw, "rounds": 3}, RunDir.open(run_dir, fleet_file), clients)
    gate = again.admission.gate.settings  # checks comparing devices with each other are outside the accountant
    assert gate.update_bound_factor is None and gate.peer_min_cosine is None and gate.direction_min_cosine is None
    assert again.privacy.ledger.charges == charges and again.privacy.clip_norm == clip
    assert again.run()
    rounds = again.rundir.metrics()
    again.rundir.close()
    assert [m.round for m in rounds] == [1, 2, 3]
    assert rounds[-1].privacy.epsilon == pytest.approx(epsilon([RoundCharge(4, 2, Z / 2)] * 3, DELTA))
    assert rounds[1].privacy.clip_norm == clip
