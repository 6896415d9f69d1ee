"""A stop that lands between two rounds (Ctrl-C right after a round closed) is a stop, not the end of the run."""

from __future__ import annotations

from pathlib import Path

from coordinator.emulation.simulation import simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from tests.digit_clients import digit_clients, digit_engine

CNN = ModelSpec("cnn", 10, 1, 8)


class StopAtClose(MemoryLink):
    """Stops ``engine`` while round 1 closes: the stop is seen only once that round is done."""

    engine: RoundEngine

    def close_round(self, round_: int) -> None:
        super().close_round(round_)
        if round_ == 1:
            self.engine.stop()


def test_a_stop_as_a_round_closes_ends_the_run_unfinished(tmp_path: Path) -> None:
    clients = digit_clients(["a", "b"])
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, 3, TrainConfig(batch_size=32))
    link = StopAtClose([LocalDevice(c.client_id, c.train, c.test) for c in clients])
    levels = {"a": 1.0, "b": 1.0}
    engine = digit_engine(tmp_path, raw, strategy, link, levels, EngineSettings(min_devices=2, wait_timeout_s=30))
    link.engine = engine

    assert engine.run() is False  # 1 of 3 rounds: `coordinator start` says "stopped; resume with", not "all done"
    assert engine.last is not None and engine.last.round == 1 and engine.next_round == 2
