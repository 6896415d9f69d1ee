import pytest
import torch

from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
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


@pytest.mark.slow
def test_a_batched_simulation_trains_its_clients_at_once_and_ends_where_one_by_one_does():
    """``batch=True``: clients of one level train together in batched steps, uploads still in assignment order;
    the same seeds give the same global model as one by one, to float rounding."""
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", 6, seed=0)
    clients = [
        SimClient(
            f"c{i}",
            1.0,
            # 64 samples each: batches of 32 and 32, the same shape for every client
            tuple(t[:64] for t in client_shard(data.train_x, data.train_y, spec, i)),
            client_shard(data.test_x, data.test_y, spec, i),
        )
        for i in range(6)
    ]
    results = {}
    for batch in (False, True):
        strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
        devices = [LocalDevice(c.client_id, c.train, c.test) for c in clients]
        link = MemoryLink(devices, "simulation", batch=batch)
        test, calibration = (data.test_x, data.test_y), data.train_x[:128]
        results[batch] = (
            simulate(strategy, clients, 2, TrainConfig(epochs=2), test, calibration, link=link),
            strategy.global_state(),
        )
    assert link.batcher is not None and link.batcher.batched_steps > 0, "no step ran batched"
    (alone, alone_state), (together, together_state) = results[False], results[True]
    assert together.failed_rounds == [] and [len(r.upload_bytes) for r in together.rounds] == [6, 6]
    assert together.final.accuracy == pytest.approx(alone.final.accuracy, abs=2 / len(data.test_y))
    for key, value in alone_state.items():
        torch.testing.assert_close(together_state[key], value, atol=1e-4, rtol=1e-3, msg=key)
