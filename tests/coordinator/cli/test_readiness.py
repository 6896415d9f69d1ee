"""What start would refuse is found by validate: each problem names the fleet.yaml key to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coordinator.cli.app import main
from coordinator.cli.readiness import start_problems
from coordinator.config.fleet import parse_fleet
from profiles.catalog import load_catalog

CATALOG = load_catalog()
DEVICES = [{"id": "pi5-01", "profile": "raspberry-pi-5"}]


def _fleet(**settings: object):
    return parse_fleet(
        {"fleet": "lab", "transport": {"broker": {"mode": "amqtt"}}, "devices": DEVICES, **settings}, CATALOG
    )


def test_a_minimal_fleet_is_told_its_data_set_needs_a_path() -> None:
    problems = start_problems(_fleet())

    assert problems == [
        "dataset.path: dataset 'cifar10' needs a path on the coordinator (its test split evaluates the global "
        "model); set dataset.path, or use name: digits or fashion_mnist (built in), or run without data: "
        "evaluation.server: false with model.in_channels and model.image_size"
    ]


def test_the_built_in_data_set_needs_nothing() -> None:
    assert start_problems(_fleet(dataset={"name": "digits"})) == []


def test_a_missing_path_and_an_unset_password_variable_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FEDFLEET_TEST_UNSET", raising=False)
    fleet = _fleet(
        dataset={"name": "cifar10", "path": "/nonexistent/cifar"},
        transport={"broker": {"mode": "amqtt", "password": "env:FEDFLEET_TEST_UNSET"}},
    )

    assert start_problems(fleet) == [
        "dataset.path: /nonexistent/cifar: no such file or folder on this machine",
        "transport.broker.password: environment variable 'FEDFLEET_TEST_UNSET' is not set",
    ]


def test_devices_in_process_are_for_simulate_not_for_start() -> None:
    assert _fleet(dataset={"name": "digits"}).transport.kind == "mqtt"  # the default: agents on the broker
    in_process = _fleet(dataset={"name": "digits"}, transport={"kind": "in_process"})

    assert start_problems(in_process) == [
        "transport.kind: in_process runs the devices inside the coordinator with their data in memory, which "
        "only simulate() sets up; start reaches real agents: use kind: mqtt (the default)"
    ]


def test_a_transport_no_package_registered_is_named_with_those_that_are() -> None:
    grpc = _fleet(dataset={"name": "digits"}, transport={"kind": "grpc"})

    assert start_problems(grpc) == [
        "transport.kind: 'grpc' is not a registered transport (registered: in_process, mqtt, websocket); "
        "a package adds one under the entry point group 'fedfleet.transports'"
    ]


def test_start_refuses_before_it_creates_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"fleet": "lab", "transport": {"broker": {"mode": "amqtt"}}, "devices": DEVICES}))

    assert main(["start", "--fleet", str(fleet), "--run-dir", str(tmp_path / "run"), "--no-live"]) == 2

    assert "dataset.path: dataset 'cifar10' needs a path" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
