"""A transport is a plugin: one module in another package, registered through an entry point, no edit of fedfleet.

The plugin here, ``loopback``, runs each device as a real agent in the coordinator's process over memory, on its
share of the fleet's dataset: enough to show that ``simulate()`` and ``coordinator start`` take whatever the
registry holds, and that the devices on it are the same ``Agent`` as on a broker.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coordinator.cli.app import main as coordinator
from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import simulate
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from coordinator.transport.registry import TRANSPORTS, transport_of, transport_problems
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from tests.digit_clients import digit_clients
from tests.plugins import installed_plugin

PLUGIN = '''
"""The loopback transport: every device of the fleet is an agent in the coordinator's process."""

from pydantic import BaseModel, ConfigDict

from coordinator.run.fleet_data import fleet_data
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from coordinator.transport.registry import TRANSPORTS, Transport
from device_agent.data.datasets import load_dataset, source_of
from device_agent.data.partition import PartitionSpec, client_shard


class LoopbackSettings(BaseModel):
    """fleet.yaml's transport: {kind: loopback, label: ...}."""

    model_config = ConfigDict(extra="forbid")
    label: str = "loopback"


class LoopbackServices:
    failure = None

    def __init__(self, fleet, settings):
        self.fleet = fleet
        self.settings = settings
        self._link = None

    def start(self):
        spec, _ = fleet_data(self.fleet)
        data = load_dataset(source_of(self.fleet.dataset.name, None), spec.image_size, spec.in_channels)
        split = PartitionSpec("iid", len(self.fleet.devices), seed=0)
        devices = [
            LocalDevice(
                device.id,
                client_shard(data.train_x, data.train_y, split, index),
                client_shard(data.test_x, data.test_y, split, index),
            )
            for index, device in enumerate(self.fleet.devices)
        ]
        self._link = MemoryLink(devices, self.fleet.fleet)

    def stop(self):
        pass

    def describe(self):
        return f"{self.settings.label}: {len(self.fleet.devices)} agents in this process"

    def link(self):
        return self._link

    def on_give_up(self, stop):
        pass


class Loopback(Transport):
    settings = LoopbackSettings

    def services(self, setup):
        return LoopbackServices(setup.fleet, self.options(setup.fleet))

    def simulation_link(self, fleet, devices, **options):
        return MemoryLink(devices, fleet.fleet, **options)


TRANSPORTS.register("loopback", Loopback())
'''
CNN = ModelSpec("cnn", 10, 1, 8)


@pytest.fixture
def loopback_plugin(tmp_path: Path) -> Iterator[None]:
    """Install the one-module plugin on sys.path with a real entry point; take it away afterwards."""
    entry_points = {"fedfleet.transports": {"loopback": "loopback_transport"}}
    with installed_plugin(tmp_path, "loopback-transport", entry_points, {"loopback_transport": PLUGIN}):
        try:
            TRANSPORTS.reload()
            yield
        finally:
            TRANSPORTS.unregister("loopback")


def test_the_built_in_transports_are_registered_and_each_says_what_it_cannot_run() -> None:
    fleet = parse_fleet(
        {"fleet": "lab", "transport": {"broker": {"mode": "amqtt"}}, "devices": [{"id": "a", "profile": "reported"}]}
    )
    in_process = fleet.model_copy(update={"transport": fleet.transport.model_copy(update={"kind": "in_process"})})
    assert {"mqtt", "in_process"} <= set(TRANSPORTS)

    assert transport_of(fleet).problems(fleet) == []  # mqtt, the default, starts a fleet
    assert "simulate() runs its devices in this process" in transport_of(fleet).problems(fleet, simulation=True)[0]
    assert "only simulate() sets up" in transport_of(in_process).problems(in_process)[0]
    shard = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    link = transport_of(in_process).simulation_link(in_process, [LocalDevice("a", shard, shard)])
    assert isinstance(link, MemoryLink) and list(link.devices) == ["a"] and link.fleet == "lab"


@pytest.mark.slow
def test_a_transport_from_another_package_runs_simulate_and_coordinator_start(
    loopback_plugin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "loopback" in TRANSPORTS
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["a", "b"])
    result = simulate(
        build_strategy("fedavg", CNN, {}, seed=0),
        clients,
        2,
        TrainConfig(batch_size=32),
        (data.test_x, data.test_y),
        data.train_x[:128],
        transport="loopback",
    )
    assert [sorted(r.upload_bytes) for r in result.rounds] == [["a", "b"], ["a", "b"]]
    assert result.final.accuracy is not None and result.final.accuracy > 0.3

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "fleet: loop\ntransport: {kind: loopback, label: bench}\nmodel: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits}\nrounds: 2\nround_deadline_s: 60\n"
        "devices:\n  - {id: pi-1, profile: raspberry-pi-5}\n  - {id: orin-1, profile: jetson-orin-nano-8gb}\n"
    )
    run = tmp_path / "run"
    code = coordinator(
        ["start", "--fleet", str(fleet), "--run-dir", str(run), "--kits", str(tmp_path / "kits"), "--no-live"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bench: 2 agents in this process" in out  # the plugin's own setting, from fleet.yaml
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(sorted(d for d, row in r["devices"].items() if row["status"] == "accepted") == ["orin-1", "pi-1"]
               for r in rounds)  # fmt: skip


def test_a_plugin_transports_own_settings_are_checked_with_their_key_path(loopback_plugin) -> None:
    base = {"fleet": "loop", "dataset": {"name": "digits"}, "devices": [{"id": "pi-1", "profile": "raspberry-pi-5"}]}
    typo = parse_fleet({**base, "transport": {"kind": "loopback", "lable": "bench"}})
    stray = parse_fleet({**base, "transport": {"kind": "mqtt", "label": "bench"}})

    assert transport_problems(typo) == ["transport.lable: Extra inputs are not permitted (did you mean 'label'?)"]
    assert transport_problems(stray) == [
        "transport.label: not a setting of transport 'mqtt' (it takes kind and broker)"
    ]
    assert transport_problems(parse_fleet({**base, "transport": {"kind": "loopback", "label": "bench"}})) == []
