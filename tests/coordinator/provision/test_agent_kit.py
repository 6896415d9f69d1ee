"""A device kit's text files as rendered from the templates: the device's values in, the shell's ``$`` kept."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import Fleet, load_fleet
from coordinator.provision.agent_kit import agent_yaml, install_text, torch_version, unit_text
from coordinator.provision.device_wheels import requirements
from coordinator.provision.layout import DeviceLayout
from coordinator.provision.wheel import build_agent_wheel
from device_agent.agent.config import AgentConfig

LAYOUT = DeviceLayout(Path("/srv/ff"), Path("/var/ff"))


def _fleet(tmp_path: Path, extra: str = "") -> Fleet:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "fleet: lab\nbroker: {mode: managed, host: 127.0.0.1, port: 8883}\n"
        f"{extra}devices:\n  - {{id: pi, profile: raspberry-pi-4}}\n  - {{id: orin, profile: jetson-orin-nano-8gb}}\n"
    )
    return load_fleet(path)[0]


def test_install_sh_gets_the_device_values_and_keeps_its_shell_variables(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, "dataset: {name: digits}\n")
    script = install_text(fleet, fleet.devices[0], LAYOUT)
    lines = script.splitlines()
    assert lines[1] == "# Install the fedfleet agent of device pi (fleet lab) under /srv/ff."
    assert "PREFIX=$ROOT/srv/ff" in lines and "STATE_DIR=$ROOT/var/ff" in lines and "KIND=cpu" in lines
    assert f"TORCH_VERSION={torch_version()}" in lines and "TORCH_SPEC=${TORCH_SPEC:-torch==$TORCH_VERSION}" in lines
    pip = '    if [ -n "${FEDFLEET_PIP:-}" ]; then $FEDFLEET_PIP "$@"; else "$VENV/bin/python" -m pip "$@"; fi'
    assert pip in lines
    assert 'pip_install "$KIT/fedfleet_agent-0.1.0-py3-none-any.whl[demo]"' in lines
    assert "    useradd --system --home-dir /var/ff --shell /usr/sbin/nologin fedfleet" in lines
    assert not any("nvidia" in line or "triton" in line for line in lines if "pip_install" in line)
    assert '    echo "then start:        systemctl enable --now fedfleet-agent"' in lines
    assert re.search(r"@[{\w]", script) is None  # no placeholder left; the shell's "$@" stays


@pytest.mark.parametrize(("dataset", "extra"), [("digits", "[demo]"), ("fashion_mnist", ""), ("cifar10", "")])
def test_only_a_digits_fleet_installs_the_demo_extra(tmp_path: Path, dataset: str, extra: str) -> None:
    """scikit-learn (the demo extra) ships digits; a Fashion-MNIST or CIFAR device has no use for it."""
    path = ", path: data" if dataset == "cifar10" else ""
    fleet = _fleet(tmp_path, f"dataset: {{name: {dataset}{path}}}\n")
    lines = install_text(fleet, fleet.devices[0], LAYOUT).splitlines()
    assert f'pip_install "$KIT/fedfleet_agent-0.1.0-py3-none-any.whl{extra}"' in lines


def test_a_fleet_with_secure_aggregation_installs_the_secagg_extra(tmp_path: Path) -> None:
    """The agent's SecAgg+ needs cryptography (X25519, ChaCha20), which only the secagg extra brings."""
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "fleet: lab\nbroker: {mode: managed, host: 127.0.0.1, port: 8883}\n"
        "dataset: {name: digits}\nstrategy: {name: fedavg}\nratios: [1]\n"
        "limits: {update_bound_factor: null, peer_min_cosine: null, peer_hard_floor: null}\n"
        "secure_aggregation: {threshold: 2, neighbours: 2}\n"
        "devices:\n" + "".join(f"  - {{id: pi{i}, profile: raspberry-pi-4}}\n" for i in range(3))
    )
    fleet = load_fleet(path)[0]
    lines = install_text(fleet, fleet.devices[0], LAYOUT).splitlines()
    assert 'pip_install "$KIT/fedfleet_agent-0.1.0-py3-none-any.whl[demo,secagg]"' in lines
    assert any(r.startswith("cryptography") for r in requirements(fleet))  # offline kits (--wheels) carry it too
    assert not any(r.startswith("cryptography") for r in requirements(_fleet(tmp_path)))
    with zipfile.ZipFile(build_agent_wheel(tmp_path / "wheels")) as wheel:
        metadata = wheel.read("fedfleet_agent-0.1.0.dist-info/METADATA").decode()
    assert "Provides-Extra: secagg" in metadata and 'Requires-Dist: cryptography>=42; extra == "secagg"' in metadata


def test_a_jetson_unit_joins_group_video_with_every_line_at_the_start(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    unit = unit_text(fleet, fleet.devices[1], LAYOUT).splitlines()
    assert "SupplementaryGroups=video" in unit
    assert "ExecStart=/srv/ff/venv/bin/device-agent run --config /srv/ff/etc/agent.yaml" in unit
    assert not any(line[:1].isspace() for line in unit)
    assert "SupplementaryGroups=video" not in unit_text(fleet, fleet.devices[0], LAYOUT)


def test_agent_yaml_says_where_the_data_goes_right_above_the_data_section(tmp_path: Path) -> None:
    extra = "dataset: {name: cifar10, path: /data/cifar}\nsecurity: {sign_uploads: true}\n"
    fleet = _fleet(tmp_path, extra)
    text = agent_yaml(fleet, 0, LAYOUT, tls=True)
    lines = text.splitlines()
    note = lines.index("data:") - 1
    assert lines[note] == "# PUT THIS DEVICE'S cifar10 DATA AT data.path (readable by user fedfleet) and edit the path"
    config = yaml.safe_load(text)
    assert list(config) == ["device", "fleet", "transport", "device_type", "state_dir", "data", "signing_key"]
    assert config["data"] == {"dataset": "cifar10", "path": "/data/cifar", "partition": "iid"}
    assert config["transport"]["broker"]["ca_file"] == "/srv/ff/etc/ca.pem"
    assert config["signing_key"] == "file:/srv/ff/etc/signing.key"


def test_a_kit_trains_on_the_samples_the_planner_sized_its_device_at(tmp_path: Path) -> None:
    extra = "dataset: {name: fashion_mnist, samples_per_device: 2000}\n"
    fleet = _fleet(tmp_path, extra)
    pi, orin = (AgentConfig.model_validate(yaml.safe_load(agent_yaml(fleet, i, LAYOUT, tls=True))) for i in (0, 1))
    assert pi.data.samples == orin.data.samples == fleet.samples_for(fleet.devices[0]) == 2000
    assert (pi.data.index, pi.data.count) == (0, 2)
    assert pi.data.test_samples is None  # no evaluation.max_samples: the whole test share
    unsized = _fleet(tmp_path, "dataset: {name: cifar10, path: /data/cifar}\n")
    assert "samples" not in yaml.safe_load(agent_yaml(unsized, 0, LAYOUT, tls=True))["data"]
    for data in ("{name: fashion_mnist}", "{name: cifar10, path: /data/cifar}"):  # built in, and the device's own
        evaluated = _fleet(tmp_path, f"dataset: {data}\nevaluation: {{max_samples: 300}}\n")
        assert yaml.safe_load(agent_yaml(evaluated, 0, LAYOUT, tls=True))["data"]["test_samples"] == 300
