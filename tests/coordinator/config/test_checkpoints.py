"""Checkpoint retention: fleet.yaml's ``checkpoints`` setting and the rounds it keeps."""

from __future__ import annotations

import pytest

from coordinator.config.checkpoints import Retention, kept_rounds
from coordinator.config.fleet import FleetError, parse_fleet
from profiles.catalog import load_catalog

MINIMAL = {
    "fleet": "lab",
    "transport": {"broker": {"mode": "managed"}},
    "devices": [{"id": "pi5-01", "profile": "raspberry-pi-5"}],
}


def test_a_fleet_keeps_the_last_three_rounds_and_the_best_by_default() -> None:
    fleet = parse_fleet(MINIMAL, load_catalog())

    assert fleet.checkpoints == Retention(keep_last=3, keep_best=True)


def test_a_bad_retention_is_named_by_its_key() -> None:
    with pytest.raises(FleetError, match=r"checkpoints\.keep_last"):
        parse_fleet({**MINIMAL, "checkpoints": {"keep_last": 0}}, load_catalog())
    with pytest.raises(FleetError, match=r"checkpoints\.keep_every"):
        parse_fleet({**MINIMAL, "checkpoints": {"keep_every": 2}}, load_catalog())


def test_the_best_round_survives_beside_the_last_ones() -> None:
    accuracy = {1: 0.4, 2: 0.9, 3: 0.5, 4: 0.6, 5: 0.7}

    assert kept_rounds(range(6), accuracy, Retention(keep_last=2)) == {2, 4, 5}
    assert kept_rounds(range(6), accuracy, Retention(keep_last=2, keep_best=False)) == {4, 5}
    assert kept_rounds([0], {}, Retention(keep_last=3)) == {0}
