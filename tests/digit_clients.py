"""Simulated devices on an iid split of scikit-learn's digits (8x8, one channel), for engine-level tests."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.emulation.simulation import SimClient
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard


def digit_clients(names: Sequence[str], levels: Sequence[float] | None = None) -> list[SimClient]:
    """One client per name, each holding shard i of an iid split (seed 0) of the train and test sets."""
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", len(names), seed=0)
    return [
        SimClient(
            name,
            1.0 if levels is None else levels[i],
            client_shard(data.train_x, data.train_y, spec, i),
            client_shard(data.test_x, data.test_y, spec, i),
        )
        for i, name in enumerate(names)
    ]
