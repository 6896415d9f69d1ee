"""Before round 1, `coordinator emulate` says whether this host can train the fleet within its deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config.fleet import load_fleet
from coordinator.emulation.capacity import host_load

DEVICES = 40


def fleet_file(
    tmp_path: Path, dataset: str = "fashion_mnist", deadline_s: int = 60, samples_per_device: int | None = None
) -> Path:
    devices = "\n".join(
        f"  - {{id: dev-{i:02d}, profile: {('raspberry-pi-5', 'jetson-orin-nano-8gb')[i % 2]}}}" for i in range(DEVICES)
    )
    cap = "" if samples_per_device is None else f", samples_per_device: {samples_per_device}"
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "fleet: lab\nbroker: {mode: managed, port: 18999}\n"
        "model: {arch: cnn, num_classes: 10, in_channels: 1, image_size: 28}\n"
        f"dataset: {{name: {dataset}, partition: iid{cap}}}\nratios: [1, 1/2, 1/4]\n"
        f"round_deadline_s: {deadline_s}\ndevices:\n{devices}\n"
    )
    return path


def test_the_host_load_scales_with_the_data_the_host_speed_and_its_cores(tmp_path: Path) -> None:
    fleet, catalog = load_fleet(fleet_file(tmp_path))
    one_core = host_load(fleet, catalog, gflops_per_core=50.0, cores=1)

    assert one_core.devices == DEVICES and one_core.smallest_level == 0.25
    assert 0 < one_core.seconds_smallest < one_core.seconds_full
    assert host_load(fleet, catalog, 50.0, cores=4).full_s == pytest.approx(one_core.full_s / 4)
    assert host_load(fleet, catalog, 100.0, cores=1).full_s == pytest.approx(one_core.full_s / 2)
    digits, _ = load_fleet(fleet_file(tmp_path, dataset="digits"))
    # 60,000 training images over the fleet against 1,797: the same devices train ~33x longer per round.
    assert host_load(digits, catalog, 50.0, cores=1).full_s < one_core.full_s / 20
    # ... and what each device trains on when the fleet caps it (1,500 images each here, half of them)
    capped, _ = load_fleet(fleet_file(tmp_path, samples_per_device=750))
    assert host_load(capped, catalog, 50.0, cores=1).full_s == pytest.approx(one_core.full_s / 2, rel=0.05)


def test_the_operator_is_told_what_to_change_when_even_the_smallest_levels_miss_the_deadline(tmp_path: Path) -> None:
    fleet, catalog = load_fleet(fleet_file(tmp_path))
    load = host_load(fleet, catalog, 50.0, cores=1)

    slow = host_load(fleet, catalog, 50.0 * load.floor_s / fleet.round_deadline_s / 2, cores=1)
    assert slow.floor_s > fleet.round_deadline_s
    assert slow.warning().startswith(f"this host is over capacity for {DEVICES} emulated devices: training alone")
    assert "over round_deadline_s 60 s" in slow.warning() and "emulate fewer devices" in slow.warning()

    between = host_load(fleet, catalog, 50.0 * (load.floor_s + load.full_s) / 2 / fleet.round_deadline_s, cores=1)
    assert between.floor_s < fleet.round_deadline_s < between.full_s
    assert between.warning().startswith(f"this host may not train every device of {DEVICES} in time")

    fast = host_load(fleet, catalog, 50.0 * load.full_s / fleet.round_deadline_s * 2, cores=1)
    assert fast.warning() is None


def test_coordinator_emulate_warns_before_it_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    from coordinator.cli import emulate
    from coordinator.cli.app import main

    monkeypatch.setattr(emulate, "measure_host_gflops", lambda *args, **kwargs: 0.01)
    monkeypatch.setattr(emulate, "run_start", lambda *args, **kwargs: 0)
    assert main(["emulate", "--fleet", str(fleet_file(tmp_path)), "--run-dir", str(tmp_path / "run")]) == 0

    assert f"warning: this host is over capacity for {DEVICES} emulated devices" in capsys.readouterr().err
