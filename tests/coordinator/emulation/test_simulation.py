import pytest
import torch

from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig


@pytest.mark.slow
@pytest.mark.parametrize(("name", "levels"), [("fedhm", (1.0, 0.25)), ("fedrolex", (1.0, 0.5))])
def test_short_simulation_learns_digits_and_counts_upload_bytes(name, levels):
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", 2, seed=0)
    clients = [
        SimClient(
            f"c{i}",
            level,
            client_shard(data.train_x, data.train_y, spec, i),
            client_shard(data.test_x, data.test_y, spec, i),
        )
        for i, level in enumerate(levels)
    ]
    strategy = build_strategy(name, ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    result = simulate(strategy, clients, 2, TrainConfig(epochs=1), (data.test_x, data.test_y), data.train_x[:128])
    assert [r.round for r in result.rounds] == [1, 2]
    assert result.final.accuracy > 0.5 and result.final.personalized_accuracy > 0.5
    full, small = (result.final.upload_bytes[c.client_id] for c in clients)
    assert small < full


def test_a_large_simulated_fleet_asks_a_fraction_of_its_clients_per_round():
    from coordinator.config.fleet import parse_fleet
    from coordinator.emulation.simulation import simulation_fleet

    empty = (torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.long))
    clients = [SimClient(f"c{i}", 1.0, empty, empty) for i in range(50)]
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    raw = simulation_fleet(strategy, clients, 3, TrainConfig(), participation=0.2)
    assert parse_fleet(raw, source="simulation").participation == 0.2
