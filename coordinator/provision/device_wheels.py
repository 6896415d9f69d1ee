"""Builder 4b (``provision --wheels``): each kit's ``wheels/``, so a device with no internet installs from the kit.

A device's profile names its platform (:func:`platform_of`): a Raspberry Pi (or a profile named arm64 /
aarch64) runs Debian bookworm, manylinux aarch64 with CPython 3.11; a Jetson on JetPack 6 is aarch64 with
CPython 3.10; an x86 CPU device is taken as x86_64 with CPython 3.11. The wheels are fetched with
``pip download --only-binary=:all: --platform ... --python-version ... --implementation cp``, torch with
``--no-deps`` (pip would evaluate its x86_64-only NVIDIA markers against this machine) and its CPU
dependencies beside it (:func:`~coordinator.provision.agent_kit.torch_cpu_requirements`), once per
platform into a cache folder, then copied into every kit of that platform.

torch per platform: aarch64 takes :data:`DEVICE_TORCH` from PyPI, the newest aarch64 torch that is a CPU
build (later ones are CUDA builds), unless an index is given (``--torch-index``, e.g. the CPU index), from
which it takes the fleet's pin. A Jetson never gets torch here: NVIDIA's wheel is placed by the user (the
kit's install.sh says where from). x86_64's torch on PyPI pulls the CUDA stack, so an x86 kit carries torch
only with ``--torch-index`` (the CPU build at the fleet's pin); without it install.sh fetches the CPU build
online. GPU laptops and Macs get no wheels: PyPI's torch is the build they need, installed online.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from coordinator.config.fleet import Device, Fleet
from coordinator.provision.agent_kit import device_class, torch_cpu_requirements, torch_version
from coordinator.provision.secrets import ProvisionError
from coordinator.provision.wheel import DEMO_DATASETS, DEMO_EXTRA, agent_requirements, extra_requirements

WHEELS = "wheels"
# The newest torch on PyPI whose aarch64 wheel is a CPU build (libtorch_cpu, OpenBLAS, Arm Compute Library;
# its NVIDIA requirements are marked x86_64-only). From 2.11 PyPI's aarch64 torch is a CUDA build (~400 MiB
# wheel, NVIDIA packages); the CPU builds of newer versions are on download.pytorch.org (``--torch-index``).
DEVICE_TORCH = "2.10.0"
_COMPLETE = ".complete"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fedfleet"


@dataclass(frozen=True)
class WheelPlatform:
    """Where a kit's wheels must run: pip's platform tags, the CPython version, which torch (None: none)."""

    name: str
    machine: str
    python: str
    torch: str | None
    note: str

    @property
    def tags(self) -> tuple[str, ...]:
        # pip widens a manylinux_2_28 tag to every older glibc; the legacy aliases catch older uploads.
        return tuple(f"{t}_{self.machine}" for t in ("manylinux_2_28", "manylinux_2_17", "manylinux2014", "linux"))

    @property
    def label(self) -> str:
        return f"{self.name} (manylinux {self.machine}, CPython {self.python})"

    def cache_name(self, torch_index: str | None) -> str:
        torch = f"torch{self.torch}" if self.torch else "notorch"
        source = "" if not torch_index or not self.torch else "-" + re.sub(r"[^A-Za-z0-9.]+", "_", torch_index)
        return f"wheels-{self.machine}-cp{self.python.replace('.', '')}-{torch}{source}"


@dataclass(frozen=True)
class WheelOptions:
    """``--wheels``: where the download cache is, an index for torch, and a find-links folder used instead of PyPI."""

    cache: Path
    torch_index: str | None = None
    find_links: Path | None = None


def platform_of(device: Device, torch_index: str | None = None) -> WheelPlatform | None:
    """The platform of ``device``'s kit, or None where the kit carries no wheels (GPU laptops, Macs, reported)."""
    kind, profile = device_class(device), device.profile
    if kind == "jetson":
        note = "no torch: put NVIDIA's JetPack 6 wheel into wheels/ (install.sh says where from)"
        return WheelPlatform("jetson", "aarch64", "3.10", None, note)
    if kind != "cpu" or profile == "reported":
        return None
    if profile.startswith("raspberry-pi") or "arm64" in profile or "aarch64" in profile:
        if torch_index:
            return WheelPlatform("arm64", "aarch64", "3.11", torch_version(), f"torch from {torch_index}")
        note = f"torch {DEVICE_TORCH}: PyPI's newest CPU-only aarch64 build (the fleet pins {torch_version()})"
        return WheelPlatform("arm64", "aarch64", "3.11", DEVICE_TORCH, note)
    if torch_index:
        return WheelPlatform("x86_64", "x86_64", "3.11", torch_version(), f"torch from {torch_index}")
    note = "no torch (PyPI's x86_64 torch is a CUDA build): install.sh fetches the CPU build, or give --torch-index"
    return WheelPlatform("x86_64", "x86_64", "3.11", None, note)


def requirements(fleet: Fleet) -> list[str]:
    """Everything beside torch a kit installs: the agent's dependencies, its extras (demo, secagg), torch's CPU ones."""
    demo = DEMO_EXTRA if fleet.dataset.name in DEMO_DATASETS else []
    secagg = extra_requirements("secagg") if fleet.secure_aggregation is not None else []
    agent = [r for r in agent_requirements() if not re.match(r"torch\b", r)]
    return [*agent, *demo, *secagg, *torch_cpu_requirements()]


def _pip_download(platform: WheelPlatform, folder: Path, options: WheelOptions, args: list[str], what: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:"]
    command += ["--python-version", platform.python, "--implementation", "cp", "-d", str(folder)]
    command += [arg for tag in platform.tags for arg in ("--platform", tag)]
    if options.find_links is not None:
        command += ["--no-index", "--find-links", str(options.find_links)]
    done = subprocess.run([*command, *args], capture_output=True, text=True)
    if done.returncode != 0:
        output = done.stdout + done.stderr
        found = re.findall(r"No matching distribution found for (\S+)", output)
        package = found[-1] if found else what
        tail = "\n".join(output.strip().splitlines()[-6:])
        raise ProvisionError(f"pip download of {package} for {platform.label} failed:\n{tail}")


def download(fleet: Fleet, platform: WheelPlatform, options: WheelOptions) -> Path:
    """The platform's wheels in the cache, downloaded once (again only when what the kit needs changed)."""
    folder = options.cache / platform.cache_name(options.torch_index)
    needs = requirements(fleet)
    key = "\n".join([f"torch=={platform.torch}" if platform.torch else "no torch", *needs]) + "\n"
    if (folder / _COMPLETE).exists() and (folder / _COMPLETE).read_text() == key:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if platform.torch:
        index = ["--index-url", options.torch_index] if options.torch_index and options.find_links is None else []
        _pip_download(platform, folder, options, [*index, "--no-deps", f"torch=={platform.torch}"], "torch")
    _pip_download(platform, folder, options, needs, "the agent's dependencies")
    (folder / _COMPLETE).write_text(key)
    return folder


def fill_kit(kit: Path, wheels: Path) -> list[str]:
    """Replace ``kit/wheels/``'s wheels with those of ``wheels`` (a torch wheel the user put there stays)."""
    target = kit / WHEELS
    target.mkdir(exist_ok=True)
    keep_torch = not any(wheels.glob("torch-*.whl"))
    for old in target.glob("*.whl"):
        if not (keep_torch and old.name.startswith("torch-")):
            old.unlink()
    for wheel in sorted(wheels.glob("*.whl")):
        shutil.copy2(wheel, target / wheel.name)
    return sorted(p.name for p in target.glob("*.whl"))


def build_device_wheels(fleet: Fleet, kits_root: Path, options: WheelOptions) -> dict[str, str]:
    """Fill every kit's wheels/ for its platform; returns device -> what its kit got (for the CLI to print)."""
    done: dict[str, str] = {}
    for device in fleet.devices:
        platform = platform_of(device, options.torch_index)
        if platform is None:
            done[device.id] = f"no wheels ({device.profile}: PyPI's torch is its build; install.sh installs online)"
            continue
        names = fill_kit(kits_root / device.id, download(fleet, platform, options))
        done[device.id] = f"{len(names)} wheels for {platform.label}; {platform.note}"
    return done
