"""`coordinator emulate` writes one agent.yaml per device: held to its profile, its own data shard, no secret."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from coordinator.config.fleet import load_fleet
from coordinator.emulation.emulator import Emulation, EmulatorError, agent_url, write_agent_specs
from coordinator.planning.planner import effective_profile, level_cost
from coordinator.transport.broker.credentials import Credentials
from device_agent.agent.config import load_config
from device_agent.agent.runtime import LocalData
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import partition
from device_agent.emulation.launcher import AgentGroup
from profiles.costmodel import Workload, predict_step_seconds

_GIB = 1024**3
HOST_GFLOPS = 72.0


def _fleet_file(tmp_path: Path, partition_text: str = "dirichlet(0.5)", extra_device: str = "") -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        f"""
fleet: lab
broker: {{mode: managed, port: 18999}}
model: {{arch: cnn, num_classes: 10}}
dataset: {{name: digits, partition: {partition_text}, seed: 3}}
devices:
  - {{id: pi4-a, profile: raspberry-pi-4}}
  - {{id: pi4-slow, profile: raspberry-pi-4, overrides: {{compute: {{fp32_gflops: 18}}, memory: {{total: 1 GiB}}}}}}
  - {{id: pi5-a, profile: raspberry-pi-5}}
  - {{id: nano-a, profile: jetson-nano}}
  - {{id: laptop-a, profile: x86-laptop-cpu}}
{extra_device}"""
    )
    return path


def _passwords(fleet) -> dict[str, str]:
    return {d.id: f"secret-of-{d.id}" for d in fleet.devices}


def test_each_device_is_held_to_its_profile_with_the_fleet_overrides(tmp_path: Path) -> None:
    fleet, catalog = load_fleet(_fleet_file(tmp_path))
    specs = write_agent_specs(
        fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet), HOST_GFLOPS
    )
    assert [s.device for s in specs] == ["pi4-a", "pi4-slow", "pi5-a", "nano-a", "laptop-a"]
    configs = {s.device: load_config(s.config) for s in specs}  # the agent's own schema accepts every file
    for device, config in configs.items():
        limits = config.emulation
        assert limits is not None and limits.threads == 1
        profile = catalog[fleet.devices[[d.id for d in fleet.devices].index(device)].profile]
        assert limits.uplink_bytes_per_s == pytest.approx(profile.network.uplink_mbps * 1e6 / 8)
        assert limits.downlink_bytes_per_s == pytest.approx(profile.network.downlink_mbps * 1e6 / 8)
        assert limits.latency_s == pytest.approx(profile.network.latency_ms / 1e3)
        assert config.fleet == "lab" and config.device == device
        assert config.state_dir == (tmp_path / "run" / "agents" / device / "state").resolve()
    pi4 = catalog["raspberry-pi-4"]
    assert configs["pi4-a"].emulation.memory_bytes == pi4.memory.usable_bytes
    assert configs["pi4-a"].emulation.slowdown == pytest.approx(HOST_GFLOPS / 36)
    # overrides apply as the planner applies them: 1 GiB total - the profile's 0.6 GiB reserved, 18 GFLOPS
    assert configs["pi4-slow"].emulation.memory_bytes == _GIB - int(pi4.memory.reserved)
    assert configs["pi4-slow"].emulation.slowdown == pytest.approx(HOST_GFLOPS / 18)
    assert configs["pi5-a"].emulation.slowdown == pytest.approx(HOST_GFLOPS / 65)
    assert configs["laptop-a"].emulation.slowdown == 1.0  # faster than this host: host speed


def test_by_default_each_step_is_held_to_the_planners_step_time_for_the_profile(tmp_path: Path) -> None:
    fleet, catalog = load_fleet(_fleet_file(tmp_path))
    specs = write_agent_specs(fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet))
    configs = {s.device: load_config(s.config).emulation for s in specs}
    batch = fleet.training.batch_size
    for device in fleet.devices:
        emulation = configs[device.id]
        profile = effective_profile(device, catalog[device.profile], None)
        assert emulation.slowdown == 1.0
        assert emulation.compute.fp32_gflops == profile.compute.fp32_gflops  # what hello reports
        assert set(emulation.step_seconds) == {*fleet.ratios, 1.0}
        for level, seconds in emulation.step_seconds.items():
            work = Workload(level_cost(fleet, level).trace, batch, fleet.training.optimizer)
            assert seconds == pytest.approx(predict_step_seconds(work, profile), rel=1e-6)
    # the slower override (18 instead of 36 GFLOPS) makes the full model's step slower
    assert configs["pi4-slow"].step_seconds[1.0] > configs["pi4-a"].step_seconds[1.0]


def test_passwords_travel_in_the_environment_not_in_the_files(tmp_path: Path) -> None:
    fleet, catalog = load_fleet(_fleet_file(tmp_path))
    specs = write_agent_specs(fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet), 50.0)
    for spec in specs:
        text = spec.config.read_text()
        assert "secret-of" not in text
        assert yaml.safe_load(text)["transport"]["broker"]["password"] == "env:FEDFLEET_PASSWORD"
        assert spec.env == {"FEDFLEET_PASSWORD": f"secret-of-{spec.device}"}
        assert "secret-of" not in repr(spec)
    with pytest.raises(EmulatorError, match=r"no broker credentials for device.*laptop-a"):
        write_agent_specs(fleet, catalog, tmp_path / "run", "mqtt://h:1", {"pi4-a": "x"}, 50.0)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet(0.5)", "permuted_labels", "domains"])
def test_data_shards_are_disjoint_and_cover_the_training_set(tmp_path: Path, scheme: str) -> None:
    fleet, catalog = load_fleet(_fleet_file(tmp_path, scheme))
    specs = write_agent_specs(fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet), 50.0)
    labels = load_dataset("digits").train_y
    shards = []
    for index, spec in enumerate(specs):
        data = load_config(spec.config).data
        assert (data.dataset, data.index, data.count, data.seed) == ("digits", index, len(specs), 3)
        split = data.partition_spec()
        assert split is not None
        shards.append(partition(labels, split)[index])  # exactly what the agent computes for itself
    together = np.concatenate(shards)
    assert len(together) == len(np.unique(together)) == len(labels)


def test_an_agent_trains_on_as_many_samples_as_the_fleet_sizes_its_device(tmp_path: Path) -> None:
    extra = "  - {id: sized, profile: raspberry-pi-4, overrides: {samples: 40}}\n"
    fleet, catalog = load_fleet(_fleet_file(tmp_path, extra_device=extra))
    specs = write_agent_specs(fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet), 50.0)
    samples = {spec.device: load_config(spec.config).data.samples for spec in specs}
    assert samples == {"pi4-a": None, "pi4-slow": None, "pi5-a": None, "nano-a": None, "laptop-a": None, "sized": 40}

    data = LocalData(SimpleNamespace(data=load_config(specs[-1].config).data))
    (x, y), (test_x, _) = data.for_model(8, 1, 10)
    assert len(y) == 40 and len(x) == 40 and len(test_x) > 0
    again = LocalData(SimpleNamespace(data=load_config(specs[-1].config).data)).for_model(8, 1, 10)[0]
    assert torch.equal(again[1], y)  # the same draw every time the agent starts


def test_an_agent_evaluates_on_as_many_test_samples_as_the_fleet_evaluates_on(tmp_path: Path) -> None:
    """evaluation.max_samples caps each device's test share as it caps the server's: one seeded draw."""
    path = _fleet_file(tmp_path, "iid")
    path.write_text(path.read_text().replace("devices:", "evaluation: {max_samples: 30}\ndevices:"))
    fleet, catalog = load_fleet(path)
    specs = write_agent_specs(fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet), 50.0)
    assert {load_config(spec.config).data.test_samples for spec in specs} == {30}
    config = load_config(specs[0].config).data
    (_, train_y), (_, test_y) = LocalData(SimpleNamespace(data=config)).for_model(8, 1, 10)
    assert len(test_y) == 30 and len(train_y) > 30  # training keeps its whole share
    again = LocalData(SimpleNamespace(data=config)).for_model(8, 1, 10)[1][1]
    assert torch.equal(again, test_y)


def test_a_device_without_a_profile_cannot_be_emulated(tmp_path: Path) -> None:
    path = _fleet_file(tmp_path, extra_device="  - {id: mystery, profile: reported}\n")
    fleet, catalog = load_fleet(path)
    with pytest.raises(EmulatorError, match=r"devices\[5\].profile: mystery is 'reported'"):
        Emulation(fleet, catalog, 50.0)


def test_agents_reach_a_broker_that_listens_everywhere_on_loopback() -> None:
    assert agent_url("mqtt://0.0.0.0:1883") == "mqtt://127.0.0.1:1883"
    assert agent_url("mqtts://broker.lab:8883") == "mqtts://broker.lab:8883"


@pytest.mark.slow
def test_launch_starts_one_agent_per_device_and_reports_a_crash(tmp_path: Path) -> None:
    """The agents here are stand-ins (a crash and sleepers); the real ones are in test_demo."""
    fleet, catalog = load_fleet(_fleet_file(tmp_path))
    script = "import sys, time; sys.exit(4) if 'pi5-a' in sys.argv[1] else time.sleep(60)"
    agents = AgentGroup(lambda config: [sys.executable, "-c", script, str(config)])
    emulation = Emulation(fleet, catalog, 50.0, agents=agents)
    credentials = {d.id: Credentials(d.id, "pw") for d in fleet.devices}
    emulation.launch("mqtt://0.0.0.0:18999", credentials, tmp_path / "run", "3.1.1")
    assert sorted(emulation.agents.pids) == sorted(credentials)
    broker = yaml.safe_load(emulation.specs[0].config.read_text())["transport"]["broker"]
    assert broker["url"] == "mqtt://127.0.0.1:18999"
    assert broker["protocol"] == "3.1.1"  # the agents speak what the broker speaks (amqtt: 3.1.1 only)
    deadline = time.monotonic() + 60
    while not emulation.crashed and time.monotonic() < deadline:
        time.sleep(0.1)
    crashed = emulation.stop()
    assert [c.device for c in crashed] == ["pi5-a"] and crashed[0].returncode == 4
    assert emulation.agents.running() == []


def test_the_command_refuses_what_it_cannot_emulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli.app import main

    path = _fleet_file(tmp_path, extra_device="  - {id: mystery, profile: reported}\n")
    assert main(["emulate", "--fleet", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    assert "devices[5].profile: mystery is 'reported'" in capsys.readouterr().err
    host_ratio = ["--pace", "host-ratio", "--host-gflops", "50"]
    assert main(["emulate", "--fleet", str(path), *host_ratio, "--run-dir", str(tmp_path / "run")]) == 2
    assert "devices[5].profile: mystery is 'reported'" in capsys.readouterr().err
    assert main(["emulate", "--fleet", str(path), "--host-gflops", "50"]) == 2
    assert "--host-gflops is only used with --pace host-ratio" in capsys.readouterr().err
    path.write_text(path.read_text().replace("raspberry-pi-5", "raspberry-pi-6"))
    assert main(["emulate", "--fleet", str(path)]) == 2
    assert "devices[2].profile: unknown profile 'raspberry-pi-6'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_an_emulated_agent_signs_with_its_kits_key(tmp_path: Path) -> None:
    fleet, catalog = load_fleet(_fleet_file(tmp_path))
    kits = tmp_path / "kits"
    (kits / "pi4-a").mkdir(parents=True)
    (kits / "pi4-a" / "signing.key").write_text("00" * 32)
    specs = write_agent_specs(
        fleet, catalog, tmp_path / "run", "mqtt://127.0.0.1:18999", _passwords(fleet), 50.0, kits=kits
    )
    configs = {spec.device: load_config(spec.config) for spec in specs}
    assert configs["pi4-a"].signing_key == f"file:{(kits / 'pi4-a' / 'signing.key').resolve()}"
    assert configs["pi4-a"].resolve_signing_key() == bytes(32)
    assert configs["pi5-a"].signing_key is None  # no key in its kit: the fleet does not sign
