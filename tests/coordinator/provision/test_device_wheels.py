"""``provision --wheels``: the real ``pip download`` per platform, offline, against a folder of tiny wheels."""

from __future__ import annotations

import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from coordinator.config.fleet import Fleet
from coordinator.provision import DeviceLayout, ProvisionError, WheelOptions, provision
from coordinator.provision.device_wheels import DEVICE_TORCH, requirements
from coordinator.provision.wheel import wheel_name
from tests.coordinator.provision.kit_fixtures import KINDS, kinds_fleet
from tests.coordinator.provision.test_install_script import Device

TORCH_WHEELS = (
    f"torch-{DEVICE_TORCH}-cp311-cp311-manylinux_2_28_aarch64.whl",
    f"torch-{DEVICE_TORCH}-cp311-cp311-manylinux_2_28_x86_64.whl",  # PyPI's x86_64 torch: never in a kit
)


def _version(requirement: Requirement) -> str:
    """A version the requirement accepts: one its specifier names, else 1.0."""
    candidates = [s.version for s in requirement.specifier] + ["1.0", "99.0"]
    return next(v for v in candidates if requirement.specifier.contains(Version(v), prereleases=True))


def tiny_wheel(folder: Path, filename: str) -> None:
    """A wheel pip accepts: METADATA (name, version), WHEEL and RECORD, no code, no dependencies."""
    name, version = filename.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / filename, "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return kinds_fleet(tmp_path_factory.mktemp("wheels-fleet"))


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory, fleet: Fleet) -> Path:
    """One tiny wheel per requirement of the kit, and torch for aarch64 and x86_64."""
    folder = tmp_path_factory.mktemp("mirror")
    for text in requirements(fleet):
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name).replace("-", "_")
        tiny_wheel(folder, f"{name}-{_version(requirement)}-py3-none-any.whl")
    for name in TORCH_WHEELS:
        tiny_wheel(folder, name)
    return folder


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory, fleet: Fleet, mirror: Path) -> Path:
    root = tmp_path_factory.mktemp("wheels-kits")
    options = WheelOptions(root / "cache", find_links=mirror)
    done = provision(fleet, root / "kits", (), DeviceLayout(), wheels=options)
    assert set(done.wheels) == set(KINDS) and "no wheels" in done.wheels["gpu"]
    return done.kits.root


def _wheels(kit: Path) -> list[str]:
    return sorted(p.name for p in (kit / "wheels").glob("*.whl")) if (kit / "wheels").is_dir() else []


def _names(kit: Path) -> set[str]:
    return {re.split(r"-", name)[0] for name in _wheels(kit)}


def test_each_kit_gets_its_platforms_wheels(kits: Path, fleet: Fleet) -> None:
    needed = {canonicalize_name(Requirement(r).name).replace("-", "_") for r in requirements(fleet)}
    assert _names(kits / "pi") == needed | {"torch"}
    assert TORCH_WHEELS[0] in _wheels(kits / "pi")  # the aarch64 CPU build, not x86_64's
    assert _names(kits / "orin") == needed  # a Jetson's torch is NVIDIA's, placed by the user
    assert _names(kits / "laptop") == needed  # PyPI's x86_64 torch pulls CUDA: left out without --torch-index
    assert _wheels(kits / "gpu") == []


def test_each_platform_is_downloaded_once_into_the_cache(kits: Path) -> None:
    cache = sorted(p.name for p in (kits.parent / "cache").iterdir())
    assert cache == [
        "wheels-aarch64-cp310-notorch",
        f"wheels-aarch64-cp311-torch{DEVICE_TORCH}",
        "wheels-x86_64-cp311-notorch",
    ]


def test_the_bundle_carries_the_wheels(kits: Path) -> None:
    with tarfile.open(kits / "pi.tar.gz") as tar:
        assert f"pi/wheels/{TORCH_WHEELS[0]}" in tar.getnames()


def test_the_pi_kit_installs_offline_from_its_wheels(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "pi", tmp_path, machine="aarch64")
    result = device.run()
    assert result.code == 0, result.err
    wheels = str(device.kit / "wheels")
    assert all(c[1:4] == ["--no-index", "--find-links", wheels] for c in result.of("pip"))
    assert result.torch_installs()[0][-2:] == ["--no-deps", "torch"]
    assert f"CPU build from the kit's wheels/ ({TORCH_WHEELS[0]})" in result.out
    assert result.of("pip")[-1][-1] == f"{device.kit}/{wheel_name()}[demo]"


def test_the_jetson_kit_still_stops_for_nvidias_torch(kits: Path, tmp_path: Path) -> None:
    device = Device(kits / "orin", tmp_path, machine="aarch64")
    device.path("/etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.0\n")
    result = device.run()
    assert result.code == 2 and "this kit needs NVIDIA's torch wheel" in result.err and not result.of("pip")


def test_a_package_pip_cannot_find_is_named_with_the_platform(fleet: Fleet, mirror: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(mirror, partial)
    for wheel in partial.glob("psutil-*"):
        wheel.unlink()
    named = r"pip download of psutil\S* for arm64 \(manylinux aarch64, CPython 3.11\)"
    with pytest.raises(ProvisionError, match=named):
        provision(fleet, tmp_path / "kits", (), DeviceLayout(), wheels=WheelOptions(tmp_path / "c", find_links=partial))


def test_the_cli_fills_the_kits_and_says_what_each_got(
    mirror: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coordinator.cli.app import main

    fleet_file = tmp_path / "fleet.yaml"
    broker = "broker: {mode: managed, host: 127.0.0.1, port: 18883, hosts: [localhost]}\n"
    fleet_file.write_text(
        f"fleet: one\n{broker}dataset: {{name: digits}}\ndevices:\n  - {{id: pi, profile: raspberry-pi-5}}\n"
    )
    argv = ["provision", "--fleet", str(fleet_file), "--out", str(tmp_path / "kits"), "--wheels"]
    argv += ["--wheels-cache", str(tmp_path / "cache"), "--wheels-from", str(mirror)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "wheels/: " in out and "for arm64 (manylinux aarch64, CPython 3.11); torch 2.10.0" in out
    assert TORCH_WHEELS[0] in _wheels(tmp_path / "kits" / "pi")
