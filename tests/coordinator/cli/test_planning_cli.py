"""coordinator profiles / validate / plan, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coordinator.cli.app import main
from coordinator.config.fleet import load_fleet
from coordinator.planning.planner import data_bytes
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program
from profiles.costmodel import Workload, predict_process_peak, trace_module
from profiles.schema import DeviceClass
from tests.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "fleet.yaml"
PLAN_KEYS = {
    "device",
    "profile",
    "ratio",
    "model",
    "trainable_params",
    "est_memory_bytes",
    "memory_budget_bytes",
    "est_round_seconds",
    "deadline_seconds",
    "reason",
    "samples",
    "batch_size",
    "local_epochs",
}


def test_plan_json_is_one_object_per_device_with_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fleet", str(EXAMPLE), "--json"]) == 0

    rows = json.loads(capsys.readouterr().out)
    assert all(set(row) == PLAN_KEYS for row in rows)
    assert all(row["ratio"] in {None, 1.0, 0.5, 0.25, 0.125} for row in rows)
    assert all(row["reason"] for row in rows)
    fleet, _ = load_fleet(EXAMPLE)  # the sizes each device's kit and assignments carry
    devices = {device.id: device for device in fleet.devices}
    assert all(row["samples"] == fleet.samples_for(devices[row["device"]]) for row in rows)
    assert all(row["batch_size"] == fleet.training.for_device(devices[row["device"]], 0).batch_size for row in rows)
    assert {row["batch_size"] for row in rows} == {32, 16}  # an override shows


def test_plan_table_names_every_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fleet", str(EXAMPLE)]) == 0

    out = capsys.readouterr().out
    assert "excluded" in out
    assert "devices planned" in out


def test_validate_accepts_the_example_once_its_data_and_passwords_are_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FEDFLEET_COORDINATOR_PASSWORD", "coordinator-secret")
    monkeypatch.setenv("FEDFLEET_RTX4060_ANA", "device-secret")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(EXAMPLE.read_text())
    (tmp_path / "data" / "cifar-10-batches-py").mkdir(parents=True)

    assert main(["validate", "--fleet", str(fleet)]) == 0

    assert "ok" in capsys.readouterr().out


def test_validate_refuses_what_start_would_refuse(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("FEDFLEET_COORDINATOR_PASSWORD", raising=False)
    assert main(["validate", "--fleet", str(EXAMPLE)]) == 1

    err = capsys.readouterr().err
    assert "cannot start here" in err
    assert f"dataset.path: {EXAMPLE.parent / 'data' / 'cifar-10-batches-py'}: no such file or folder" in err
    assert "transport.broker.password: environment variable 'FEDFLEET_COORDINATOR_PASSWORD' is not set" in err


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


def _plan_as(strategy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], **changes: object) -> list[dict]:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["strategy"] = {"name": strategy, "params": {}}
    data.update(changes)
    path = tmp_path / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", "--fleet", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "changes"), [("heterofl", {}), ("factorized_fl", {"ratios": [1]})])
def test_each_strategy_is_planned_with_the_model_its_devices_really_train(
    strategy: str, changes: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fedhm = _plan_as("fedhm", tmp_path, capsys)
    rows = _plan_as(strategy, tmp_path, capsys, **changes)
    fleet, catalog = load_fleet(EXAMPLE)
    model = ModelSpec("resnet18", 10, 3, 32)
    real = build_strategy(strategy, model)
    planned = [(row, device) for row, device in zip(rows, fleet.devices, strict=True) if row["ratio"] is not None]

    assert [(r["ratio"], r["est_memory_bytes"]) for r in rows] != [(r["ratio"], r["est_memory_bytes"]) for r in fedhm]
    assert planned
    for level in {row["ratio"] for row, _ in planned}:
        # The device's own program, built on the CPU from a real assignment, traced independently.
        [assignment] = real.configure(1, [ClientSlot("d", level, 100)]).values()
        program_model = build_program(assignment.spec, assignment.tensors).model
        trainable = sum(p.numel() for p in program_model.parameters() if p.requires_grad)
        trace = trace_module(program_model, 3, 32)
        for row, device in [(r, d) for r, d in planned if r["ratio"] == level]:
            batch = device.overrides.batch_size or fleet.training.batch_size
            work = Workload(trace, batch, fleet.training.optimizer)
            assert row["trainable_params"] == trainable
            peak = predict_process_peak(
                work,
                catalog[device.profile].accelerator,
                download_bytes=type(real).download_bytes(model, real.params, level),
                upload_bytes=type(real).upload_bytes(model, real.params, level),
                data_bytes=data_bytes(fleet, device),
                samples=fleet.samples_for(device),
            )
            assert row["est_memory_bytes"] == peak.total
            assert row["model"] == ("full model" if strategy == "factorized_fl" else f"width {level:g}")
