"""A private run through the real round engine (in-process devices): epsilon per round, and the budget stop."""

import pytest

from coordinator.emulation.simulation import SimClient, simulate
from coordinator.privacy.accountant import planned_epsilon
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig

DELTA = 1e-3


def clients(levels):
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", len(levels), seed=0)
    shards = [
        SimClient(
            f"c{i}",
            level,
            client_shard(data.train_x, data.train_y, spec, i),
            client_shard(data.test_x, data.test_y, spec, i),
        )
        for i, level in enumerate(levels)
    ]
    return shards, (data.test_x, data.test_y), data.train_x[:128]


@pytest.mark.slow
def test_a_fedhm_run_at_mixed_levels_reports_epsilon_each_round_and_stops_at_its_budget():
    z = 2.0
    two, three = (planned_epsilon(4, 4, rounds, z, DELTA) for rounds in (2, 3))
    shards, test, calibration = clients([1.0, 0.5, 0.25, 0.25])
    strategy = build_strategy("fedhm", ModelSpec("cnn", 10, 1, 8), {"weighting": "uniform"}, seed=0)
    privacy = {"noise_multiplier": z, "delta": DELTA, "clip": {"mode": "adaptive"}, "budget_epsilon": (two + three) / 2}
    result = simulate(strategy, shards, 3, TrainConfig(epochs=1), test, calibration, privacy=privacy)
    assert [r.round for r in result.rounds] == [1, 2]  # round 3 would have passed the budget
    assert [r.epsilon for r in result.rounds] == pytest.approx([planned_epsilon(4, 4, 1, z, DELTA), two])


@pytest.mark.slow
def test_a_drawn_device_whose_round_fails_is_still_charged(monkeypatch: pytest.MonkeyPatch):
    """Dropping out after the draw must not buy privacy: the round is charged for every device drawn."""
    from device_agent.clients import PROGRAMS
    from tests.program_bugs import with_first_upload_bug

    monkeypatch.setitem(PROGRAMS, "fedavg", with_first_upload_bug(PROGRAMS["fedavg"]))
    shards, test, calibration = clients([1.0] * 4)
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    privacy = {"noise_multiplier": 2.0, "delta": DELTA, "clip": 0.5}
    result = simulate(strategy, shards, 1, TrainConfig(epochs=1), test, calibration, privacy=privacy)
    (only,) = result.rounds
    assert len(only.upload_bytes) == 3  # one of the four drawn devices failed its round
    assert only.epsilon == pytest.approx(planned_epsilon(4, 4, 1, 2.0, DELTA))
