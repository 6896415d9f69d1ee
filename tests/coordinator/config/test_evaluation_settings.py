"""fleet.yaml ``evaluation``: server-side evaluation is on by default and can be turned off, by a real bool."""

from __future__ import annotations

import pytest

from coordinator.cli.readiness import start_problems
from coordinator.config.fleet import FleetError, parse_fleet
from coordinator.run.fleet_data import fleet_data
from profiles.catalog import load_catalog

CATALOG = load_catalog()
FLEET = {
    "fleet": "lab",
    "transport": {"broker": {"mode": "managed"}},
    "devices": [{"id": "pi5-01", "profile": "raspberry-pi-5"}],
}


def test_the_server_evaluates_unless_told_not_to() -> None:
    assert parse_fleet(FLEET, CATALOG).evaluation.server is True
    assert parse_fleet({**FLEET, "evaluation": {"server": False}}, CATALOG).evaluation.server is False


@pytest.mark.parametrize(
    ("evaluation", "problem"),
    [
        ({"server": "off"}, r"evaluation\.server.*valid boolean"),
        ({"sever": False}, r"evaluation\.sever.*Extra inputs are not permitted"),
        ("no", r"evaluation.*valid dictionary"),
        ({"max_samples": 0}, r"evaluation\.max_samples: Input should be greater than 0"),
        ({"max_sample": 10}, r"evaluation\.max_sample: .*did you mean 'max_samples'"),
    ],
)
def test_a_bad_evaluation_section_is_named_by_its_key(evaluation, problem) -> None:
    with pytest.raises(FleetError, match=problem):
        parse_fleet({**FLEET, "evaluation": evaluation}, CATALOG)


def test_a_coordinator_that_does_not_evaluate_and_knows_the_input_shape_needs_no_data() -> None:
    elsewhere = {"name": "npz", "path": "/nowhere/on/this/machine.npz", "samples_per_device": 500}
    model = {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8}
    fleet = parse_fleet({**FLEET, "dataset": elsewhere, "model": model, "evaluation": {"server": False}}, CATALOG)

    assert start_problems(fleet) == []
    spec, data = fleet_data(fleet)
    assert (spec.in_channels, spec.image_size, len(data.test_y)) == (1, 8, 0)


def test_without_the_input_shape_the_data_set_is_still_needed_for_it() -> None:
    elsewhere = {"name": "npz", "path": "/nowhere/on/this/machine.npz", "samples_per_device": 500}
    fleet = parse_fleet({**FLEET, "dataset": elsewhere, "evaluation": {"server": False}}, CATALOG)

    assert start_problems(fleet) == [
        "dataset.path: /nowhere/on/this/machine.npz: no such file or folder on this machine"
    ]
