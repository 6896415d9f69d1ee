import json

import pytest

from benchmarks.emulation import device_time, main
from coordinator.transport.broker.mosquitto import find_mosquitto


@pytest.mark.slow
def test_json_output_reports_each_limit_as_a_ratio(capsys):
    args = ["--factors", "2", "--steps", "3", "--rates", "2e7", "--megabytes", "1", "--budgets-mib", "128"]
    assert main([*args, "--demo-rounds", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "emulation"
    assert result["slowdown"][0]["factor"] == 2 and result["slowdown"][0]["measured_vs_own_compute"] > 1.5
    assert 0.5 < result["link"][0]["measured_vs_configured"] <= 1.05
    assert 0 < result["memory"][0]["largest_tensor_vs_budget"] <= 1
    assert result["device_time"] == []


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_emulated_devices_take_the_predicted_training_time_unless_the_host_is_slower():
    rows = device_time(rounds=1)
    assert {row["device_class"] for row in rows} == {"jetson-orin-nano-8gb", "raspberry-pi-5", "raspberry-pi-4"}
    for row in rows:
        assert row["host_seconds"] <= row["emulated_seconds"] * 1.01
        # never faster than the device (sleep granularity aside); as fast as it when the host keeps up
        assert row["emulated_vs_predicted"] >= 0.9, row
        if not row["host_bound"]:
            assert row["emulated_vs_predicted"] <= 1.25, row
        else:
            assert row["emulated_seconds"] == pytest.approx(row["host_seconds"], rel=0.25), row


def test_the_scale_fleet_draws_fashion_mnist_shards_at_28x28() -> None:
    from benchmarks.scale_fleet import ScaleData, scale_fleet
    from coordinator.config.fleet import parse_fleet

    fleet = parse_fleet(scale_fleet(1000, 18999, ScaleData("fashion_mnist")), source="scale")
    assert fleet.dataset.name == "fashion_mnist" and (fleet.model.in_channels, fleet.model.image_size) == (1, 28)
    assert fleet.samples_for(fleet.devices[-1]) == 60  # the planner's share of the 60,000 at 1,000 devices


def test_fashion_mnist_at_scale_is_eight_14x14_images_a_device_unless_told_otherwise() -> None:
    from benchmarks.scale_fleet import ScaleData, scale_fleet
    from coordinator.config.fleet import parse_fleet

    recipe = ScaleData.recipe("fashion_mnist")
    fleet = parse_fleet(scale_fleet(2000, 18999, recipe), source="scale")
    assert (fleet.model.image_size, fleet.dataset.samples_per_device) == (14, 8)
    assert recipe.images_per_device(2000) == 8
    assert ScaleData.recipe("fashion_mnist", 0, 28).images_per_device(2000) == 30  # 0: the 60,000 split evenly
    assert ScaleData.recipe("digits") == ScaleData("digits")  # digits stay whole, at their own 8x8
    assert ScaleData.recipe("fashion_mnist", 16).args() == [
        "--dataset", "fashion_mnist", "--samples-per-device", "16", "--image-size", "14"
    ]  # fmt: skip


def test_the_scale_fleet_takes_a_longer_round_deadline_when_asked() -> None:
    from benchmarks.scale_fleet import ScaleData, scale_fleet
    from coordinator.config.fleet import parse_fleet

    data = ScaleData("fashion_mnist")
    assert parse_fleet(scale_fleet(30, 18999, data, 300.0), source="scale").round_deadline_s == 300
    assert scale_fleet(30, 18999)["round_deadline_s"] == 60  # the demo's, unless asked


def test_a_fleet_larger_than_the_data_set_is_refused_before_anything_starts(capsys) -> None:
    assert main(["--scale", "--scale-dataset", "digits", "--devices", "2000"]) == 2
    assert (
        "digits has 1437 training images: 2000 devices would leave 563 of them without data" in capsys.readouterr().err
    )


def test_a_run_past_its_time_is_stopped_with_everything_it_started() -> None:
    import contextlib
    import subprocess
    import sys
    import time

    import psutil

    from benchmarks.emulation_scale import _stop_tree

    # a coordinator too loaded to stop on SIGTERM, with a worker of its own
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    )
    emulate = subprocess.Popen([sys.executable, "-c", script])
    process = psutil.Process(emulate.pid)
    deadline = time.monotonic() + 60
    while not process.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = process.children()[0]
    _stop_tree(emulate, process, grace_s=0.5)
    assert emulate.returncode is not None
    with contextlib.suppress(psutil.TimeoutExpired):
        worker.wait(timeout=10)
    with contextlib.suppress(psutil.NoSuchProcess):
        assert worker.status() == psutil.STATUS_ZOMBIE  # killed; its new parent may not have reaped it yet
