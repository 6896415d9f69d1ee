"""Profiles become agent limits; agent.yaml files are written for `device-agent emulate` without the coordinator."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from device_agent.cli.app import build_parser
from device_agent.cli.emulate import agent_specs
from device_agent.emulation.profile_config import (
    DataShare,
    EmulationError,
    agent_config,
    find_profile,
    limits_for,
    write_agent_config,
)

_GIB = 1024**3


def test_limits_follow_the_profile() -> None:
    pi5 = find_profile("raspberry-pi-5")  # 8 GiB, 0.8 GiB reserved, 65 GFLOPS, 230/240 Mbit/s, 3 ms
    limits = limits_for(pi5, host_gflops=130.0, threads=2)
    assert limits.profile == "raspberry-pi-5"
    assert limits.threads == 2
    assert limits.memory_bytes == 8 * _GIB - int(0.8 * _GIB)
    assert limits.slowdown == pytest.approx(2.0)
    assert limits.uplink_bytes_per_s == pytest.approx(230e6 / 8)
    assert limits.downlink_bytes_per_s == pytest.approx(240e6 / 8)
    assert limits.latency_s == pytest.approx(0.003)


def test_a_device_faster_than_the_host_runs_at_host_speed() -> None:
    assert limits_for(find_profile("rtx-4060-laptop"), host_gflops=40.0).slowdown == 1.0


def test_user_profiles_win_and_can_be_given_by_path(tmp_path: Path) -> None:
    mine = {
        "name": "raspberry-pi-5",
        "title": "our slow Pi",
        "accelerator": "cpu",
        "memory": {"total": "2 GiB", "shared": True, "reserved": "0.5 GiB"},
        "compute": {"fp32_gflops": 10},
        "network": {"downlink_mbps": 8, "uplink_mbps": 4, "latency_ms": 40},
        "sources": [{"fields": ["compute.fp32_gflops"], "ref": "measured"}],
    }
    path = tmp_path / "pi.yaml"
    path.write_text(yaml.safe_dump(mine))
    by_name = find_profile("raspberry-pi-5", [tmp_path])
    assert by_name.compute.fp32_gflops == 10
    assert find_profile(str(path)) == by_name
    assert limits_for(by_name, 20.0).memory_bytes == int(1.5 * _GIB)


def test_bad_profiles_are_named(tmp_path: Path) -> None:
    with pytest.raises(EmulationError, match="did you mean 'raspberry-pi-5'"):
        find_profile("raspbery-pi-5")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\naccelerator: cpu\nmemory: {total: 1 GiB, shared: true}\ncompute: {fp32_gflops: -1}\n")
    with pytest.raises(EmulationError, match=r"bad.yaml: compute.fp32_gflops: .*greater than.*network: Field req"):
        find_profile(str(bad))


def test_agent_config_round_trips_through_the_agent_schema(tmp_path: Path, monkeypatch) -> None:
    from device_agent.agent.config import load_config, parse_config
    from device_agent.agent.port import MqttPort

    limits = limits_for(find_profile("jetson-nano"), host_gflops=472.0)
    share = DataShare("digits", "dirichlet(0.5)", 7, index=2, count=8)
    path = write_agent_config(
        tmp_path / "agent.yaml",
        agent_config("nano-02", "demo", "mqtt://127.0.0.1:1884", share, tmp_path / "state", limits),
    )
    config = load_config(path)
    assert config.device == "nano-02" and config.fleet == "demo"
    assert config.broker.password == "env:FEDFLEET_PASSWORD"
    assert config.broker.keepalive_s == 120  # a loaded emulation host, not the device, may keep it silent
    assert parse_config({"device": "d", "fleet": "f"}).broker.keepalive_s == 30  # a real device's default
    monkeypatch.setenv("FEDFLEET_PASSWORD", "pw")
    assert MqttPort(config).keepalive_s == 120  # what its session connects with
    assert (config.data.index, config.data.count, config.data.seed) == (2, 8, 7)
    spec = config.data.partition_spec()
    assert spec is not None and spec.scheme == "dirichlet" and spec.alpha == 0.5
    assert config.emulation is not None
    assert config.emulation.slowdown == pytest.approx(2.0)
    assert config.emulation.memory_bytes == limits.memory_bytes


def test_bulk_configs_take_global_indices_and_per_device_passwords(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "emulate",
            "--profile", "raspberry-pi-4",
            "--count", "3",
            "--first-index", "4",
            "--total", "8",
            "--prefix", "pi",
            "--broker", "mqtt://10.0.0.5:1883",
            "--fleet", "lab",
            "--password", "file:/secrets/{device}.pw",
            "--partition", "permuted_labels",
            "--run-dir", str(tmp_path),
        ]
    )  # fmt: skip
    specs = agent_specs(args, host_gflops=72.0)
    assert [s.device for s in specs] == ["pi-04", "pi-05", "pi-06"]
    configs = [yaml.safe_load(s.config.read_text()) for s in specs]
    assert [(c["data"]["index"], c["data"]["count"]) for c in configs] == [(4, 8), (5, 8), (6, 8)]
    assert configs[1]["transport"]["broker"]["password"] == "file:/secrets/pi-05.pw"
    assert configs[0]["emulation"]["slowdown"] == pytest.approx(2.0)  # 72 / 36 GFLOPS
    assert all(s.log == tmp_path / s.device / "agent.log" for s in specs)
    args.total = 5
    with pytest.raises(EmulationError, match="exceeds --total 5"):
        agent_specs(args, host_gflops=72.0)


@pytest.mark.slow
def test_the_agent_side_never_imports_coordinator_or_profiles_code() -> None:
    script = textwrap.dedent(
        """
        import sys
        from device_agent.cli.app import build_parser
        from device_agent.emulation.profile_config import find_profile, limits_for
        limits_for(find_profile("raspberry-pi-5"), 100.0)
        build_parser().parse_args(["emulate", "--profile", "x", "--count", "2", "--broker", "mqtt://h", "--fleet", "f"])
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("coordinator", "profiles")))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
