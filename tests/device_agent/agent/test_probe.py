"""The probe's report has the shape of a device profile, and can measure the link to a broker."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from device_agent.agent.probe import measure_broker_link, measure_training_efficiency, probe_device
from device_agent.cli.app import main
from device_agent.common.profile import DeviceProfile
from profiles.catalog import profile_from_report
from profiles.schema import DeviceClass

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)


def test_probe_output_validates_as_a_device_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu", "--seconds", "0.05", "--json"]) == 0
    report = DeviceProfile.model_validate_json(capsys.readouterr().out)

    profile = profile_from_report(report)

    assert isinstance(profile, DeviceClass)
    assert profile.accelerator == "cpu"
    assert profile.memory.shared
    assert profile.memory.usable_bytes == report.memory_available_bytes
    assert profile.compute.fp32_gflops == report.matmul_gflops
    assert profile.compute.memory_bandwidth_gbs > 0
    # On a CPU it also measures what the cost model needs for large tensors and for convolutions.
    assert profile.compute.fresh_memory_bandwidth_gbs > 0 and profile.compute.training_efficiency > 0
    # The measured sections are the very models static profile files are made of.
    assert type(profile.memory) is type(report.memory)
    assert type(profile.compute) is type(report.compute)


def test_probe_reports_software_versions() -> None:
    report = probe_device(benchmark_seconds=0.05, device="cpu")

    assert {"numpy", "pydantic", "paho-mqtt", "safetensors"} <= set(report.versions)
    assert report.network is None, "no broker was given, so no link was measured"


def test_a_report_without_the_new_sections_still_validates() -> None:
    """Senders built before the profile sections existed keep working; the sections are derived."""
    flat = {
        "hostname": "old-agent",
        "platform": "Linux",
        "machine": "aarch64",
        "python": "3.10",
        "torch": "2.1",
        "cpu_count": 4,
        "memory_total_bytes": 4 * 2**30,
        "memory_available_bytes": 3 * 2**30,
        "accelerator": "cuda",
        "accelerator_name": "Orin",
        "accelerator_memory_bytes": 4 * 2**30,
        "matmul_gflops": 900.0,
    }

    report = DeviceProfile.model_validate(flat)

    assert report.memory.total == 4 * 2**30
    assert report.compute.fp32_gflops == 900.0
    assert report.compute.memory_bandwidth_gbs is None


def test_an_unreachable_broker_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot reach broker 127.0.0.1:{port}"):
        measure_broker_link(f"mqtt://127.0.0.1:{port}", timeout=2)


def test_a_broker_url_must_be_mqtt() -> None:
    with pytest.raises(ValueError, match="mqtt://host:port"):
        measure_broker_link("http://example.org")


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[str]:
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tmp_path / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    process = subprocess.Popen([MOSQUITTO, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    pytest.fail("mosquitto did not start")
                time.sleep(0.05)
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.mark.slow
def test_probe_measures_the_link_to_a_real_broker(mosquitto: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu", "--seconds", "0.05", "--broker", mosquitto]) == 0
    report = DeviceProfile.model_validate(json.loads(capsys.readouterr().out))

    assert report.network is not None
    assert report.network.uplink_mbps > 1  # loopback through mosquitto: far above any Wi-Fi
    assert 0 <= report.network.latency_ms < 1000
    assert profile_from_report(report).network == report.network

    assert main(["probe", "--device", "cpu", "--seconds", "0.05", "--human", "--broker", mosquitto]) == 0
    assert "broker link:" in capsys.readouterr().out


def test_a_training_efficiency_skewed_by_a_busy_host_stays_within_what_a_profile_accepts() -> None:
    # A matmul rate measured far too low or too high (the scheduler cut one timing short) would give a ratio the
    # profile refuses, failing the agent's start; it is kept to the profile's range instead.
    cpu = torch.device("cpu")
    assert measure_training_efficiency(cpu, matmul_gflops=1e-9) == 4
    assert measure_training_efficiency(cpu, matmul_gflops=1e12) == 1e-3
