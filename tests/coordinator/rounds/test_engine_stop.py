"""A stop that lands between two rounds (Ctrl-C right after a round closed) is a stop, not the end of the run."""

from __future__ import annotations

from pathlib import Path

import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)


class StopAtClose(MemoryLink):
    """Stops ``engine`` while round 1 closes: the stop is seen only once that round is done."""

    engine: RoundEngine

    def close_round(self, round_: int) -> None:
        super().close_round(round_)
        if round_ == 1:
            self.engine.stop()


def test_a_stop_as_a_round_closes_ends_the_run_unfinished(tmp_path: Path) -> None:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["a", "b"])
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, 3, TrainConfig(batch_size=32))
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(raw))
    link = StopAtClose([LocalDevice(c.client_id, c.train, c.test) for c in clients])
    calibration = data.train_x[:128]
    engine = RoundEngine(
        parse_fleet(raw),
        {},
        strategy,
        RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0),
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        link,
        EngineSettings(min_devices=2, wait_timeout_s=30),
        planner=fixed_levels({"a": 1.0, "b": 1.0}),
    )
    link.engine = engine

    assert engine.run() is False  # 1 of 3 rounds: `coordinator start` says "stopped; resume with", not "all done"
    assert engine.last is not None and engine.last.round == 1 and engine.next_round == 2
