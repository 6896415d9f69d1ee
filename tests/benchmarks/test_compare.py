"""benchmarks.compare runs every strategy through the round engine, not a loop of its own."""

from __future__ import annotations

import pytest

from benchmarks import compare
from coordinator.engine import RoundEngine
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset


@pytest.mark.slow
def test_a_setting_runs_through_the_round_engine(monkeypatch) -> None:
    runs: list[str] = []
    original = RoundEngine.run

    def spy(self, *args, **kwargs):
        runs.append(self.strategy.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RoundEngine, "run", spy)
    data = load_dataset("digits", 8, 1)
    setting = compare.scenarios(4, seed=0)["hetero-devices"][0]
    row = compare.run_setting("fedhm", setting, data, rounds=1, train=TrainConfig(batch_size=32))
    assert runs == ["fedhm"]
    assert 0 < row["accuracy"] <= 1 and 0 < row["personalized_accuracy"] <= 1
    assert row["upload_bytes_per_round"] > 0
