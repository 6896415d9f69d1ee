"""Each personalized strategy through the in-process simulation on digits with permuted labels."""

import pytest
import torch

from coordinator.emulation.simulation import SimClient, simulate, tensor_bytes
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.models import build_model
from device_agent.training.optimizer import TrainConfig


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(autouse=True)
def one_thread():
    """Small convolutions on shared cores run faster on one thread than fighting over several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["factorized_fl", "factorized_fl_beta", "simfed", "fedfac"])
def test_three_rounds_beat_chance_personally(digits, name):
    spec = PartitionSpec("iid", 4, 0, permute_labels=True)
    clients = [
        SimClient(
            f"c{i}",
            1.0,
            client_shard(digits.train_x, digits.train_y, spec, i, digits.num_classes),
            client_shard(digits.test_x, digits.test_y, spec, i, digits.num_classes),
        )
        for i in range(4)
    ]
    model = ModelSpec("cnn", digits.num_classes, digits.in_channels, digits.image_size)
    strategy = build_strategy(name, model, {}, seed=0)
    torch.manual_seed(0)
    result = simulate(
        strategy,
        clients,
        3,
        TrainConfig(epochs=1, batch_size=32, lr=0.05),
        (digits.test_x, digits.test_y),
        digits.train_x[:128],
    )
    assert result.final.personalized_accuracy > 0.3  # chance is 0.1
    dense = tensor_bytes(build_model("cnn", digits.num_classes).state_dict())
    if name == "factorized_fl":
        assert result.upload_bytes_per_round * 10 <= dense
    assert all(strategy.personalized_state(c.client_id) is not None for c in clients)
