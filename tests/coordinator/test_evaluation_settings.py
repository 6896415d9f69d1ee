"""fleet.yaml ``evaluation``: server-side evaluation is on by default and can be turned off, by a real bool."""

from __future__ import annotations

import pytest

from coordinator.fleet import FleetError, parse_fleet
from profiles.catalog import load_catalog

CATALOG = load_catalog()
FLEET = {"fleet": "lab", "broker": {"mode": "managed"}, "devices": [{"id": "pi5-01", "profile": "raspberry-pi-5"}]}


def test_the_server_evaluates_unless_told_not_to() -> None:
    assert parse_fleet(FLEET, CATALOG).evaluation.server is True
    assert parse_fleet({**FLEET, "evaluation": {"server": False}}, CATALOG).evaluation.server is False


@pytest.mark.parametrize(
    ("evaluation", "problem"),
    [
        ({"server": "off"}, r"evaluation\.server.*valid boolean"),
        ({"sever": False}, r"evaluation\.sever.*Extra inputs are not permitted"),
        ("no", r"evaluation.*valid dictionary"),
    ],
)
def test_a_bad_evaluation_section_is_named_by_its_key(evaluation, problem) -> None:
    with pytest.raises(FleetError, match=problem):
        parse_fleet({**FLEET, "evaluation": evaluation}, CATALOG)
