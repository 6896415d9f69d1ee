"""The coordinator's copy of the data comes at the size the fleet's model takes."""

from __future__ import annotations

import pytest

from coordinator.config.fleet import parse_fleet
from coordinator.run.fleet_data import fleet_data


def fleet(arch: str, **model: int) -> dict:
    return {
        "fleet": "sizes",
        "transport": {"broker": {"mode": "managed"}},
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


def test_server_evaluation_can_use_a_fixed_seeded_subset_of_the_test_split() -> None:
    """``evaluation.max_samples``: fewer images to evaluate each round, the same ones every round."""
    whole = fleet_data(parse_fleet(fleet("cnn"), source="test"))[1]
    capped = {**fleet("cnn"), "evaluation": {"max_samples": 100}}
    _, first = fleet_data(parse_fleet(capped, source="test"))
    _, again = fleet_data(parse_fleet(capped, source="test"))

    assert len(whole.test_y) > 300 and len(first.test_y) == 100
    assert first.test_x.equal(again.test_x) and first.test_y.equal(again.test_y)
    assert len(first.train_y) == len(whole.train_y)  # static BN still calibrates on the train split
    assert len(set(first.test_y.tolist())) == 10  # a draw over the split, not its first 100 images
    large = {**fleet("cnn"), "evaluation": {"max_samples": 10_000}}
    assert len(fleet_data(parse_fleet(large, source="test"))[1].test_y) == len(whole.test_y)
