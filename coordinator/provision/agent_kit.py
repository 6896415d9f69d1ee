"""Builder 4: one device's kit, ``kits/<device>/``: everything a person copies onto the device.

agent.yaml (references only), the password and client key (0600), its certificate and the CA,
the agent wheel, ``install.sh`` and ``uninstall.sh``, the systemd unit, cloud-init user-data and a README. The paths
inside agent.yaml and the unit are those the device will have after ``install.sh``: ``PREFIX``
(default /opt/fedfleet) for the venv and ``PREFIX/etc``, the state directory for outbox and logs.
The text files are the templates of :mod:`coordinator.provision.templates`; this module only
works out the values that differ per device.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import shlex
import shutil
from pathlib import Path

import yaml

from coordinator.config.fleet import Device, Fleet
from coordinator.provision.layout import (
    CA_CERT,
    CLIENT_CERT,
    CLIENT_KEY,
    DOCTOR_CERT,
    DOCTOR_KEY,
    DOCTOR_PASSWORD,
    PASSWORD,
    SIGNING_KEY,
    DeviceLayout,
    Kits,
)
from coordinator.provision.templates import render
from coordinator.provision.wheel import DEMO_DATASETS, wheel_name
from coordinator.transport.broker.credentials import write_file
from coordinator.transport.registry import DeviceFiles, transport_of
from device_agent.data.datasets import BUILT_IN
from device_agent.emulation.profile_config import DataShare

UNIT = "fedfleet-agent.service"
INSTALL = "install.sh"
UNINSTALL = "uninstall.sh"
USER_DATA = "user-data"
SERVICE_USER = "fedfleet"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# NVIDIA's torch wheels for JetPack 6 (CUDA 12.6), named in the Jetson kit's instructions.
JETSON_INDEX = "https://pypi.jetson-ai-lab.io/jp6/cu126"
# torch's Linux wheels on PyPI require these (CUDA runtime, cuDNN, NCCL, triton...): never on a CPU device.
CUDA_PACKAGES = re.compile(r"^(nvidia-|cuda-|triton|pytorch-triton)", re.IGNORECASE)
# On a Jetson the GPU's device nodes belong to group video: the unit's user joins it.
JETSON_GROUPS = "SupplementaryGroups=video\n"


def broker_url(fleet: Fleet) -> str:
    """The URL devices dial, as the fleet's transport says (``mqtt``: the broker's)."""
    return transport_of(fleet).dial_url(fleet)


def device_class(device: Device) -> str:
    """How torch gets onto the device: ``jetson`` (NVIDIA's wheel), ``cuda`` / ``mac`` (PyPI), ``cpu`` (CPU index)."""
    if device.profile.startswith("jetson"):
        return "jetson"
    if device.profile.startswith("rtx"):
        return "cuda"
    if device.profile.startswith("apple"):
        return "mac"
    return "cpu"


@functools.cache
def torch_version() -> str:
    """The fleet's torch: this coordinator's, without a local suffix (2.13.0+cpu -> 2.13.0) so any build matches.

    Read once per process: each read parses torch's METADATA, and every kit asks (300 kits: ~1 CPU-s).
    """
    return importlib.metadata.version("torch").split("+", 1)[0]


@functools.cache
def torch_cpu_requirements() -> tuple[str, ...]:
    """torch's own dependencies minus the CUDA ones: what a CPU device installs beside a ``--no-deps`` torch.

    Read once per process, like :func:`torch_version` (300 kits: ~2.6 CPU-s of METADATA parsing).
    """
    requires = importlib.metadata.requires("torch") or []
    return tuple(r for r in requires if "extra ==" not in r and not CUDA_PACKAGES.match(r))


def _yaml(mapping: dict[str, object]) -> str:
    return yaml.safe_dump(mapping, sort_keys=False).removesuffix("\n")


def agent_yaml(
    fleet: Fleet, index: int, layout: DeviceLayout, tls: bool, password_ref: str | None = None, doctor: bool = False
) -> str:
    """agent.yaml text with comments; the data section is a placeholder unless the data set is built in.

    ``doctor``: the kit carries the device's read-only doctor login (``broker.doctor``).
    """
    device = fleet.devices[index]
    dataset = fleet.dataset
    login: dict[str, str] | None = None
    if doctor:
        login = {"password": f"file:{layout.etc / DOCTOR_PASSWORD}"}
        if tls:
            login |= {"cert_file": str(layout.etc / DOCTOR_CERT), "key_file": str(layout.etc / DOCTOR_KEY)}
    certificates = (layout.etc / CA_CERT, layout.etc / CLIENT_CERT, layout.etc / CLIENT_KEY) if tls else (None,) * 3
    files = DeviceFiles(password_ref or f"file:{layout.etc / PASSWORD}", *map(_text, certificates), doctor=login)
    samples = fleet.sized_samples(device)  # what the planner sized this device at: the agent trains on as many
    if dataset.name in BUILT_IN and dataset.path is None:
        count, tests = len(fleet.devices), fleet.evaluation.max_samples
        share = DataShare(dataset.name, dataset.partition.text, dataset.seed, index, count, None, samples, tests)
        data, note = share.as_config(), "built-in demo data: this device takes share `index` of `count`"
    else:
        path = dataset.path or layout.state_dir / "data"
        data = {"dataset": dataset.name, "path": str(path), "partition": "iid"}
        if samples is not None:
            data["samples"] = samples
        if fleet.evaluation.max_samples is not None:
            data["test_samples"] = fleet.evaluation.max_samples
        note = f"PUT THIS DEVICE'S {dataset.name} DATA AT data.path (readable by user {SERVICE_USER}) and edit the path"
    settings = {
        "device": device.id,
        "fleet": fleet.fleet,
        **transport_of(fleet).agent_settings(fleet, files),
        "device_type": "auto",
        "state_dir": str(layout.state_dir),
    }
    rest: dict[str, object] = {"data": data}
    if fleet.security.sign_uploads:
        rest["signing_key"] = f"file:{layout.etc / SIGNING_KEY}"
    return render(
        "agent.yaml", device=device.id, fleet=fleet.fleet, settings=_yaml(settings), data_note=note, data=_yaml(rest)
    )


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def unit_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    groups = JETSON_GROUPS if device_class(device) == "jetson" else ""
    return render(UNIT, device=device.id, fleet=fleet.fleet, user=SERVICE_USER, groups=groups, command=layout.command())


def agent_extras(fleet: Fleet) -> str:
    """The agent wheel's extras a device of ``fleet`` installs: ``demo`` for the built-in digits (scikit-learn),
    ``secagg`` when fleet.yaml asks for ``secure_aggregation`` (cryptography: X25519, ChaCha20)."""
    extras = [
        name
        for name, wanted in (("demo", fleet.dataset.name in DEMO_DATASETS), ("secagg", fleet.secure_aggregation))
        if wanted
    ]
    return f"[{','.join(extras)}]" if extras else ""


def install_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    return render(
        INSTALL,
        device=device.id,
        fleet=fleet.fleet,
        prefix=layout.prefix,
        state_dir=layout.state_dir,
        command=layout.command(),
        kind=device_class(device),
        torch_version=torch_version(),
        torch_deps=" ".join(shlex.quote(r) for r in torch_cpu_requirements()),
        torch_cpu_index=TORCH_CPU_INDEX,
        jetson_index=JETSON_INDEX,
        wheel=wheel_name(),
        extra=agent_extras(fleet),
        ca_cert=CA_CERT,
        client_cert=CLIENT_CERT,
        password=PASSWORD,
        client_key=CLIENT_KEY,
        signing_key=SIGNING_KEY,
        doctor_cert=DOCTOR_CERT,
        doctor_password=DOCTOR_PASSWORD,
        doctor_key=DOCTOR_KEY,
        user=SERVICE_USER,
        unit=UNIT,
        service=UNIT.removesuffix(".service"),
    )


def uninstall_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    return render(
        UNINSTALL,
        device=device.id,
        fleet=fleet.fleet,
        prefix=layout.prefix,
        state_dir=layout.state_dir,
        user=SERVICE_USER,
        unit=UNIT,
        service=UNIT.removesuffix(".service"),
    )


def readme_text(fleet: Fleet, device: Device, layout: DeviceLayout) -> str:
    return render(
        "README.md",
        device=device.id,
        fleet=fleet.fleet,
        doctor=layout.command("doctor"),
        prefix=layout.prefix,
        etc=layout.etc,
        kind=device_class(device),
        user=SERVICE_USER,
        password=PASSWORD,
        client_cert=CLIENT_CERT,
        client_key=CLIENT_KEY,
        signing_key=SIGNING_KEY,
    )


def user_data_text(device: Device) -> str:
    """cloud-init for a freshly flashed SD card: copy the bundle to the boot partition next to this file."""
    return render(USER_DATA, device=device.id)


def build_agent_kit(
    fleet: Fleet,
    index: int,
    kits: Kits,
    wheel: Path,
    layout: DeviceLayout,
    password_ref: str | None = None,
    doctor: bool = False,
) -> Path:
    """Write kits/<device>/ (the secrets, certificates and CA are already there); ``password_ref`` is
    fleet.yaml's reference for a device whose password the kit does not carry; ``doctor``: the kit
    holds the device's doctor login."""
    device = fleet.devices[index]
    folder = kits.participant(device.id)
    tls = transport_of(fleet).kit_tls(fleet)
    if not tls:
        for name in (CA_CERT, CLIENT_CERT, CLIENT_KEY, DOCTOR_CERT, DOCTOR_KEY):
            (folder / name).unlink(missing_ok=True)
    write_file(folder / "agent.yaml", agent_yaml(fleet, index, layout, tls, password_ref, doctor), 0o644)
    write_file(folder / INSTALL, install_text(fleet, device, layout), 0o755)
    write_file(folder / UNINSTALL, uninstall_text(fleet, device, layout), 0o755)
    write_file(folder / UNIT, unit_text(fleet, device, layout), 0o644)
    write_file(folder / "README.md", readme_text(fleet, device, layout), 0o644)
    write_file(folder / USER_DATA, user_data_text(device), 0o644)
    shutil.copyfile(wheel, folder / wheel.name)
    return folder
