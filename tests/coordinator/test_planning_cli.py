"""coordinator profiles / validate / plan, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.cli import main
from profiles.schema import DeviceClass

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"
PLAN_KEYS = {
    "device",
    "profile",
    "ratio",
    "est_memory_bytes",
    "memory_budget_bytes",
    "est_round_seconds",
    "deadline_seconds",
    "reason",
}


def test_plan_json_is_one_object_per_device_with_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fleet", str(EXAMPLE), "--json"]) == 0

    rows = json.loads(capsys.readouterr().out)
    assert all(set(row) == PLAN_KEYS for row in rows)
    assert all(row["ratio"] in {None, 1.0, 0.5, 0.25, 0.125} for row in rows)
    assert all(row["reason"] for row in rows)


def test_plan_table_names_every_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fleet", str(EXAMPLE)]) == 0

    out = capsys.readouterr().out
    assert "excluded" in out
    assert "devices planned" in out


def test_validate_accepts_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--fleet", str(EXAMPLE)]) == 0

    assert "ok" in capsys.readouterr().out


def test_validate_prints_the_key_path_of_a_mistake(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(EXAMPLE.read_text().replace("profile: jetson-nano\n", "profile: jetson-nanoo\n"))

    assert main(["validate", "--fleet", str(fleet)]) == 1
    assert main(["plan", "--fleet", str(fleet)]) == 1

    err = capsys.readouterr().err
    assert "devices[5].profile: unknown profile 'jetson-nanoo' (did you mean 'jetson-nano'?)" in err


def test_profiles_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "--json"]) == 0

    profiles = [DeviceClass.model_validate(item) for item in json.loads(capsys.readouterr().out)]
    assert len(profiles) >= 12

    assert main(["profiles"]) == 0
    assert "raspberry-pi-5" in capsys.readouterr().out


def test_a_missing_profile_directory_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "--dir", str(tmp_path / "nope")]) == 1

    assert "does not exist" in capsys.readouterr().err
