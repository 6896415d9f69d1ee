"""Find device-class profiles: the ones shipped with fedfleet plus any directories a user adds.

User profiles are plain YAML files of the same schema. A user file with the name of a shipped
profile replaces it (a lab that measured its own Raspberry Pis knows better than the datasheet).
Directories come from the caller (e.g. fleet.yaml's ``profile_dirs``) and from the
``FEDFLEET_PROFILES`` environment variable (os.pathsep-separated).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from device_agent.common.paths import PROFILES_ENV, profile_dirs, profile_files
from device_agent.common.profile import DeviceProfile
from device_agent.common.validation import describe
from profiles.schema import DeviceClass

ENV_VAR = PROFILES_ENV
# A reported device that has not measured its link: a modest Wi-Fi guess, on the safe side.
_UNMEASURED_NETWORK = {"downlink_mbps": 50.0, "uplink_mbps": 20.0, "latency_ms": 20.0}


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the key path."""


def load_profile(path: Path) -> DeviceClass:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: {exc}") from None
    try:
        return DeviceClass.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{path}:\n" + describe(exc, sep="\n")) from None


def builtin_profile_files() -> list[Path]:
    folder = resources.files("profiles") / "devices"
    return sorted(Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith((".yaml", ".yml")))


@dataclass
class Catalog(Mapping[str, DeviceClass]):
    """Profiles by name, remembering which file each came from."""

    profiles: dict[str, DeviceClass] = field(default_factory=dict)
    origins: dict[str, Path] = field(default_factory=dict)

    def __getitem__(self, name: str) -> DeviceClass:
        try:
            return self.profiles[name]
        except KeyError:
            raise KeyError(unknown_profile_message(name, self.profiles)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.profiles)

    def __len__(self) -> int:
        return len(self.profiles)

    def add(self, profile: DeviceClass, origin: Path) -> None:
        self.profiles[profile.name] = profile
        self.origins[profile.name] = origin


def unknown_profile_message(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else " (see `coordinator profiles`)"
    return f"unknown profile {name!r}{hint}"


def load_catalog(extra_dirs: Iterable[Path] = (), include_builtin: bool = True) -> Catalog:
    """Shipped profiles, then ``FEDFLEET_PROFILES`` directories, then ``extra_dirs``; later names win."""
    catalog = Catalog()
    files: list[Path] = []
    for directory in profile_dirs(extra_dirs, shipped=include_builtin):
        try:
            files.extend(profile_files(Path(directory)))
        except NotADirectoryError as exc:
            raise ProfileError(str(exc)) from None
    for path in files:
        catalog.add(load_profile(path), path)
    return catalog


def profile_from_report(report: DeviceProfile, base: DeviceClass | None = None) -> DeviceClass:
    """A device's measured report as a profile: measured values win, unmeasured ones keep ``base``.

    Without a base (a device declared ``profile: reported``) the network section falls back to a
    conservative Wi-Fi guess until the device measures its link with ``--broker``.
    """
    measured_compute = report.compute.model_dump(exclude_none=True)
    compute = {**(base.compute.model_dump() if base else {}), **measured_compute}
    network = report.network or (base.network if base else _UNMEASURED_NETWORK)
    name = base.name if base else "reported"
    return DeviceClass(
        name=name,
        title=f"{report.hostname} (measured{', ' + base.title if base else ''})",
        accelerator=report.accelerator if report.accelerator in {"cpu", "cuda", "mps"} else "cpu",
        memory=report.memory,
        compute=compute,
        network=network,
        sources=[
            *(base.sources if base else []),
            _measured_source(report),
        ],
        notes=f"measured by device-agent probe on {report.hostname} ({report.platform})",
    )


def _measured_source(report: DeviceProfile) -> dict:
    fields = ["memory.total", "memory.shared", "memory.reserved", "compute.fp32_gflops"]
    fields += [f"compute.{name}" for name, value in report.compute if name != "fp32_gflops" and value is not None]
    if report.network is not None:
        fields += ["network.downlink_mbps", "network.uplink_mbps", "network.latency_ms"]
    return {"fields": fields, "ref": f"device-agent probe on {report.hostname}", "estimate": False}
