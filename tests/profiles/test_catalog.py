"""The device-profile catalog: shipped files, user directories, measured reports over datasheets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from device_agent.common.profile import DeviceProfile
from profiles.catalog import (
    ENV_VAR,
    ProfileError,
    builtin_profile_files,
    load_catalog,
    load_profile,
    profile_from_report,
)
from profiles.schema import DeviceClass

REQUIRED_CLASSES = {
    "jetson-nano",
    "jetson-orin-nano-4gb",
    "jetson-orin-nano-8gb",
    "jetson-orin-nx-16gb",
    "jetson-agx-orin-64gb",
    "raspberry-pi-4",
    "raspberry-pi-5",
    "rtx-3050-laptop",
    "rtx-3060-laptop",
    "rtx-4060-laptop",
    "apple-m1",
    "x86-laptop-cpu",
    "ci-2core",
}


@pytest.mark.parametrize("path", builtin_profile_files(), ids=lambda p: p.stem)
def test_every_shipped_profile_loads_and_is_named_after_its_file(path: Path) -> None:
    profile = load_profile(path)

    assert profile.name == path.stem
    assert profile.memory.usable_bytes > 0
    assert profile.sources, "every profile says where its numbers come from"


def test_the_catalog_covers_the_device_classes_of_the_issue() -> None:
    catalog = load_catalog()

    assert set(catalog) >= REQUIRED_CLASSES
    assert catalog["jetson-orin-nano-8gb"].memory.shared
    assert not catalog["rtx-3060-laptop"].memory.shared
    # devices.md marks the Orin Nano's FP32 figure as an estimate; the profile must say so too.
    assert "compute.fp32_gflops" in catalog["jetson-orin-nano-8gb"].estimated_fields
    assert "compute.fp32_gflops" not in catalog["jetson-orin-nx-16gb"].estimated_fields


def _write_profile(folder: Path, name: str, total: str) -> Path:
    data = yaml.safe_load(builtin_profile_files()[0].read_text())
    data.update(name=name, title=f"custom {name}")
    data["memory"]["total"] = total
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_user_directory_adds_profiles_and_replaces_shipped_ones(tmp_path: Path) -> None:
    _write_profile(tmp_path, "lab-box", "32 GiB")
    _write_profile(tmp_path, "apple-m1", "16 GiB")

    catalog = load_catalog([tmp_path])

    assert catalog["lab-box"].title == "custom lab-box"
    assert catalog["apple-m1"].memory.total == 16 * 2**30
    assert catalog.origins["apple-m1"] == tmp_path / "apple-m1.yaml"


def test_profile_directories_come_from_the_environment_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_profile(tmp_path, "env-box", "6 GiB")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))

    assert load_catalog()["env-box"].memory.total == 6 * 2**30


def test_the_planner_and_the_emulator_find_a_name_in_the_same_file(tmp_path: Path, monkeypatch) -> None:
    """One search order (shipped, $FEDFLEET_PROFILES, then a config's folders): a later folder's profile
    of a shipped name replaces it for both."""
    from device_agent.emulation.profile_config import find_profile

    _write_profile(tmp_path, "raspberry-pi-5", "7 GiB")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))

    assert load_catalog().origins["raspberry-pi-5"] == tmp_path / "raspberry-pi-5.yaml"
    assert load_catalog()["raspberry-pi-5"].memory.total == 7 * 2**30 == find_profile("raspberry-pi-5").memory.total


def test_an_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(KeyError, match="did you mean 'jetson-nano'"):
        load_catalog()["jetson-nanoo"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["memory"].pop("total"), "memory.total: Field required"),
        (
            lambda d: d["compute"].update(fp32_gflops=-1),
            "compute.fp32_gflops: Input should be greater than or equal to 0.001",
        ),
        (lambda d: d["sources"][0].update(fields=["compute.teraflops"]), "unknown field(s) compute.teraflops"),
        (lambda d: d["memory"].update(reserved="9 GiB"), "must be below total"),
        (lambda d: d.update(accelerator="tpu"), "accelerator: Input should be 'cpu', 'cuda' or 'mps'"),
    ],
)
def test_a_broken_profile_file_names_the_file_and_the_key(tmp_path: Path, edit, message: str) -> None:
    path = _write_profile(tmp_path, "broken", "8 GiB")
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))

    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)


def _report(**changes: object) -> DeviceProfile:
    flat = {
        "hostname": "pi-lab-7",
        "platform": "Linux-6.6-aarch64",
        "machine": "aarch64",
        "python": "3.11.2",
        "torch": "2.13.0",
        "cpu_count": 4,
        "memory_total_bytes": 8 * 2**30,
        "memory_available_bytes": 6 * 2**30,
        "accelerator": "cpu",
        "accelerator_name": None,
        "accelerator_memory_bytes": None,
        "matmul_gflops": 21.5,
    }
    return DeviceProfile.model_validate({**flat, **changes})


def test_a_measured_report_overrides_what_it_measured_and_keeps_the_rest() -> None:
    base = load_catalog()["raspberry-pi-5"]

    measured = profile_from_report(_report(), base)

    assert isinstance(measured, DeviceClass)
    assert measured.compute.fp32_gflops == 21.5
    assert measured.memory.usable_bytes == 6 * 2**30
    # The report measured neither bandwidth nor the link: the datasheet values stay.
    assert measured.compute.memory_bandwidth_gbs == base.compute.memory_bandwidth_gbs
    assert measured.network == base.network
    assert measured.sources[-1].ref == "device-agent probe on pi-lab-7"


def test_a_report_alone_is_a_complete_profile() -> None:
    profile = profile_from_report(_report(network={"downlink_mbps": 80, "uplink_mbps": 40, "latency_ms": 5}))

    assert profile.name == "reported"
    assert profile.network.uplink_mbps == 40
    assert profile.accelerator == "cpu"


def _top_level_modules_after(statement: str) -> set[str]:
    code = f"{statement}; import sys; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(result.stdout.split())


@pytest.mark.slow
def test_profiles_never_import_the_coordinator_and_the_agent_never_imports_profiles() -> None:
    assert not _top_level_modules_after("import profiles.catalog, profiles.costmodel") & {"coordinator", "benchmarks"}
    assert "profiles" not in _top_level_modules_after("import device_agent.cli.app, device_agent.agent.probe")
