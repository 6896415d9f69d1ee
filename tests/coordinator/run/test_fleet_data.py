"""The coordinator's copy of the data comes at the size the fleet's model takes."""

from __future__ import annotations

import pytest

from coordinator.config.fleet import parse_fleet
from coordinator.run.fleet_data import fleet_data


def fleet(arch: str, **model: int) -> dict:
    return {
        "fleet": "sizes",
        "broker": {"mode": "managed"},
        "model": {"arch": arch, "num_classes": 10, **model},
        "dataset": {"name": "digits", "partition": "iid"},
        "strategy": {"name": "fedavg"},
        "rounds": 1,
        "devices": [{"id": "pi-1", "profile": "raspberry-pi-4"}],
    }


@pytest.mark.parametrize(
    ("arch", "model", "size"),
    [
        ("cnn", {}, 8),  # a CNN takes the data set's own size
        ("cnn", {"image_size": 16}, 16),  # fleet.yaml's size wins
        ("vit_fmnist", {}, 28),  # a ViT takes only its card's size: digits are resized to it
    ],
)
def test_images_come_at_the_size_the_model_takes(arch: str, model: dict, size: int) -> None:
    spec, data = fleet_data(parse_fleet(fleet(arch, **model), source="test"))

    assert spec.image_size == size
    assert tuple(data.test_x.shape[-2:]) == (size, size)
