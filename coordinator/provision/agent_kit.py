"""Builder 4: one device's kit, ``kits/<device>/``: everything a person copies onto the device.

agent.yaml (references only), the password and client key (0600), its certificate and the CA,
the agent wheel, ``install.sh``, the systemd unit, cloud-init user-data and a README. The paths
inside agent.yaml and the unit are those the device will have after ``install.sh``: ``PREFIX``
(default /opt/fedfleet) for the venv and ``PREFIX/etc``, the state directory for outbox and logs.
"""

from __future__ import annotations

import shutil
import socket
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

from coordinator.config.fleet import Device, Fleet
from coordinator.provision.layout import CA_CERT, CLIENT_CERT, CLIENT_KEY, PASSWORD, SIGNING_KEY, Kits
from coordinator.provision.wheel import wheel_name
from coordinator.transport.broker.credentials import write_file
from device_agent.emulation.profile_config import DataShare

UNIT = "fedfleet-agent.service"
INSTALL = "install.sh"
USER_DATA = "user-data"
SERVICE_USER = "fedfleet"
BUILT_IN = ("digits",)
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@dataclass(frozen=True)
class DeviceLayout:
    """Where the kit's files land on the device."""

    prefix: Path = Path("/opt/fedfleet")
    state_dir: Path = Path("/var/lib/fedfleet")

    @property
    def etc(self) -> Path:
        return self.prefix / "etc"

    @property
    def agent(self) -> Path:
        return self.prefix / "venv" / "bin" / "device-agent"

    @property
    def config(self) -> Path:
        return self.etc / "agent.yaml"

    def command(self, verb: str = "run") -> str:
        return f"{self.agent} {verb} --config {self.config}"


def broker_url(fleet: Fleet) -> str:
    """The URL devices dial: external url, else the first of broker.hosts (else the listen address or this host)."""
    broker = fleet.broker
    if broker.mode == "external":
        assert broker.url is not None
        return broker.url
    host = broker.hosts[0] if broker.hosts else broker.host if broker.host != "0.0.0.0" else socket.gethostname()
    return f"{'mqtts' if broker.tls else 'mqtt'}://{host}:{broker.port}"


def device_class(device: Device) -> str:
    """How torch gets onto the device: ``jetson`` (NVIDIA's wheel), ``cuda`` / ``mac`` (PyPI), ``cpu`` (CPU index)."""
    if device.profile.startswith("jetson"):
        return "jetson"
    if device.profile.startswith("rtx"):
        return "cuda"
    if device.profile.startswith("apple"):
        return "mac"
    return "cpu"


def agent_yaml(fleet: Fleet, index: int, layout: DeviceLayout, tls: bool, password_ref: str | None = None) -> str:
    """agent.yaml text with comments; the data section is a placeholder unless the data set is built in."""
    device = fleet.devices[index]
    dataset = fleet.dataset
    broker = {"url": broker_url(fleet), "password": password_ref or f"file:{layout.etc / PASSWORD}"}
    if tls:
        broker |= {
            "ca_file": str(layout.etc / CA_CERT),
            "cert_file": str(layout.etc / CLIENT_CERT),
            "key_file": str(layout.etc / CLIENT_KEY),
        }
    if dataset.name in BUILT_IN:
        share = DataShare(dataset.name, dataset.partition.text, dataset.seed, index, len(fleet.devices), None)
        data, note = share.as_config(), "built-in demo data: this device takes share `index` of `count`"
    else:
        path = dataset.path or layout.state_dir / "data"
        data = {"dataset": dataset.name, "path": str(path), "partition": "iid"}
        note = f"PUT THIS DEVICE'S {dataset.name} DATA AT data.path (readable by user {SERVICE_USER}) and edit the path"
    config = {
        "device": device.id,
        "fleet": fleet.fleet,
        "broker": broker,
        "device_type": "auto",
        "state_dir": str(layout.state_dir),
        "data": data,
    }
    if fleet.security.sign_uploads:
        config["signing_key"] = f"file:{layout.etc / SIGNING_KEY}"
    head = (
        f"# fedfleet agent for device {device.id} of fleet {fleet.fleet}; written by `coordinator provision`.\n"
        "# Secrets are files next to this one (references only here). Check: device-agent doctor --config THIS_FILE\n"
    )
    body = yaml.safe_dump(config, sort_keys=False)
    return head + body.replace("\ndata:\n", f"\n# {note}\ndata:\n", 1)


def unit_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    groups = "SupplementaryGroups=video\n" if device_class(device) == "jetson" else ""
    return textwrap.dedent(
        f"""\
        [Unit]
        Description=fedfleet device agent ({device.id}, fleet {fleet.fleet})
        After=network-online.target time-sync.target
        Wants=network-online.target

        [Service]
        Type=simple
        User={SERVICE_USER}
        Group={SERVICE_USER}
        {groups}ExecStart={layout.command()}
        Restart=on-failure
        RestartSec=10
        StateDirectory=fedfleet
        StateDirectoryMode=0750
        Environment=PYTHONUNBUFFERED=1
        StandardOutput=journal
        StandardError=journal
        SyslogIdentifier=fedfleet-agent
        NoNewPrivileges=true
        ProtectSystem=full
        ProtectHome=true
        PrivateTmp=true

        [Install]
        WantedBy=multi-user.target
        """
    ).replace("\n\n\n", "\n\n")


def install_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    kind = device_class(device)
    extra = "[demo]" if fleet.dataset.name in BUILT_IN else ""
    return f"""#!/bin/sh
# Install the fedfleet agent of device {device.id} (fleet {fleet.fleet}) under {layout.prefix}.
#   sudo sh install.sh           venv, torch ({kind}), the agent wheel, config and secrets, systemd unit
# Environment: PYTHON (default python3), TORCH_SPEC (default torch), TORCH_INDEX_URL, NO_SERVICE=1 (skip the
# user and unit), PIP_* (pip's own options). With a wheels/ folder in the kit, everything installs offline.
set -eu
KIT=$(cd "$(dirname "$0")" && pwd)
PREFIX={layout.prefix}
PYTHON=${{PYTHON:-python3}}
TORCH_SPEC=${{TORCH_SPEC:-torch}}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "fedfleet agent needs Python >= 3.10 ($PYTHON is $("$PYTHON" -V 2>&1))." >&2
    echo "Jetson Nano (JetPack 4, Python 3.6) cannot run it; Orin boards on JetPack 6 can." >&2
    exit 1
fi
[ -x "$PREFIX/venv/bin/python" ] || "$PYTHON" -m venv "$PREFIX/venv"
PIP="$PREFIX/venv/bin/python -m pip"
OFFLINE=""
[ -d "$KIT/wheels" ] && OFFLINE="--no-index --find-links $KIT/wheels"
if "$PREFIX/venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "torch: already installed in $PREFIX/venv"
else
    case {kind} in
    jetson)
        echo "Jetson: PyPI's aarch64 torch has no CUDA. Install NVIDIA's JetPack wheel into the venv, e.g." >&2
        echo "  $PIP install torch --index-url https://pypi.jetson-ai-lab.io/jp6/cu126   (JetPack 6)" >&2
        echo "  or the wheel from https://developer.nvidia.com/embedded/downloads for your JetPack," >&2
        echo "then run this script again. (TORCH_INDEX_URL=$TORCH_CPU_INDEX runs CPU-only.)" >&2
        [ -n "${{TORCH_INDEX_URL:-}}" ] || exit 2
        $PIP install $OFFLINE "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL" ;;
    cpu)
        # The CPU index: no CUDA wheels (gigabytes) on a Raspberry Pi or an x86 box without a GPU.
        if [ -n "$OFFLINE" ]; then $PIP install $OFFLINE "$TORCH_SPEC"
        else $PIP install "$TORCH_SPEC" --index-url "${{TORCH_INDEX_URL:-{TORCH_CPU_INDEX}}}"; fi ;;
    *)
        $PIP install $OFFLINE "$TORCH_SPEC" ${{TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}} ;;
    esac
fi
$PIP install $OFFLINE "$KIT/{wheel_name()}{extra}"
install -d -m 0755 "$PREFIX/etc"
install -m 0644 "$KIT/agent.yaml" "$PREFIX/etc/"
for public in {CA_CERT} {CLIENT_CERT}; do
    if [ -f "$KIT/$public" ]; then install -m 0644 "$KIT/$public" "$PREFIX/etc/"; fi
done
for secret in {PASSWORD} {CLIENT_KEY} {SIGNING_KEY}; do
    if [ -f "$KIT/$secret" ]; then install -m 0600 "$KIT/$secret" "$PREFIX/etc/"; fi
done
if [ "${{NO_SERVICE:-0}}" != 1 ] && [ "$(id -u)" = 0 ] && command -v systemctl >/dev/null 2>&1; then
    id {SERVICE_USER} >/dev/null 2>&1 || \\
        useradd --system --home-dir {layout.state_dir} --shell /usr/sbin/nologin {SERVICE_USER}
    for secret in {PASSWORD} {CLIENT_KEY} {SIGNING_KEY}; do
        if [ -f "$PREFIX/etc/$secret" ]; then chown {SERVICE_USER}:{SERVICE_USER} "$PREFIX/etc/$secret"; fi
    done
    install -m 0644 "$KIT/{UNIT}" /etc/systemd/system/{UNIT}
    systemctl daemon-reload
    echo "installed; check:  $PREFIX/venv/bin/device-agent doctor --config $PREFIX/etc/agent.yaml"
    echo "then start:        systemctl enable --now {UNIT.removesuffix(".service")}"
else
    echo "installed (no service); run: {layout.command()}"
fi
"""


def readme_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    return f"""# fedfleet kit: device {device.id}, fleet {fleet.fleet}

Copy `{device.id}.tar.gz` onto the device, then:

    tar xzf {device.id}.tar.gz && sudo sh {device.id}/install.sh
    sudo {layout.command("doctor")}
    sudo systemctl enable --now fedfleet-agent

`install.sh` makes a venv in {layout.prefix}/venv (torch for a `{device_class(device)}` device, then the
agent wheel), copies agent.yaml and the secrets to {layout.etc} (secrets mode 0600, owned by the
`{SERVICE_USER}` user) and installs the systemd unit. Logs: `journalctl -u fedfleet-agent -f`.
`doctor` checks the broker, TLS, the login, the agent's topics, torch, the data and the disk.

Keep `{PASSWORD}` and `{CLIENT_KEY}` secret: together they are this device's identity (so is `{SIGNING_KEY}`,
where the fleet signs uploads). If they leak,
re-provision with `coordinator provision --rotate {device.id}` and install the new kit.
Python >= 3.10 is needed (a Jetson Nano on JetPack 4 has 3.6 and cannot run the agent).
"""


def user_data_text(device: Device, layout: DeviceLayout) -> str:
    """cloud-init for a freshly flashed SD card: copy the bundle to the boot partition next to this file."""
    return f"""#cloud-config
# First boot of a freshly flashed device (Raspberry Pi OS / Ubuntu with cloud-init): copy this file as
# `user-data` and {device.id}.tar.gz onto the boot partition; the agent is installed and started once online.
runcmd:
  - [sh, -c, "mkdir -p /root/fedfleet-kit && tar xzf /boot/firmware/{device.id}.tar.gz -C /root/fedfleet-kit"]
  - [sh, /root/fedfleet-kit/{device.id}/install.sh]
  - [systemctl, enable, --now, fedfleet-agent]
"""


def build_agent_kit(
    fleet: Fleet, index: int, kits: Kits, wheel: Path, layout: DeviceLayout, password_ref: str | None = None
) -> Path:
    """Write kits/<device>/ (the secrets, certificates and CA are already there); ``password_ref`` is
    fleet.yaml's reference for a device whose password the kit does not carry."""
    device = fleet.devices[index]
    folder = kits.participant(device.id)
    tls = fleet.broker.tls and fleet.broker.mode == "managed"
    if not tls:
        for name in (CA_CERT, CLIENT_CERT, CLIENT_KEY):
            (folder / name).unlink(missing_ok=True)
    write_file(folder / "agent.yaml", agent_yaml(fleet, index, layout, tls, password_ref), 0o644)
    write_file(folder / INSTALL, install_text(fleet, device, layout), 0o755)
    write_file(folder / UNIT, unit_text(fleet, device, layout), 0o644)
    write_file(folder / "README.md", readme_text(fleet, device, layout), 0o644)
    write_file(folder / USER_DATA, user_data_text(device, layout), 0o644)
    shutil.copyfile(wheel, folder / wheel.name)
    return folder
