"""From a device profile to the agent.yaml of one emulated device.

An emulated device is a real agent process held to a profile: the ``emulation:`` block of its
agent.yaml carries plain numbers (threads, memory cap, slowdown, link rates) that the runtime
applies through :mod:`device_agent.emulation.limits` and :mod:`device_agent.emulation.shaping`. This module computes
those numbers and writes the files; both ``coordinator emulate`` (one host, the whole fleet) and
``device-agent emulate`` (bulk agents on a further host) use it, so an emulated Raspberry Pi is
the same whichever command started it.

Profiles are read as YAML data (the files in the ``profiles`` package, ``$FEDFLEET_PROFILES``
and any directory the caller names) and validated with the agent's own probe models, so the
agent never imports the coordinator's planning code.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from device_agent.agent.config import parse_config
from device_agent.agent.probe import measure_matmul_gflops, resolve_device
from device_agent.common.atomic import atomic_write
from device_agent.common.names import PASSWORD_ENV
from device_agent.common.paths import profile_dirs, profile_files
from device_agent.common.profile import ComputeSpec, MemorySpec, NetworkSpec
from device_agent.common.validation import describe
from device_agent.emulation.limits import slowdown_factor


def password_env(index: int | None = None) -> str:
    """The variable holding a device's broker password: one per process, or one per device of a worker."""
    return PASSWORD_ENV if index is None else f"{PASSWORD_ENV}_{index}"


class EmulationError(ValueError):
    """A profile or an emulation setting that cannot be used; the message names the file and key."""


class ProfileSpec(BaseModel):
    """The parts of a device-class profile that emulation needs (the planner's schema has more)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    accelerator: Literal["cpu", "cuda", "mps"]
    memory: MemorySpec
    compute: ComputeSpec
    network: NetworkSpec


@dataclass(frozen=True)
class EmulationLimits:
    """What holds one agent process to its profile: the agent.yaml ``emulation:`` block."""

    profile: str
    threads: int
    memory_bytes: int
    slowdown: float
    uplink_bytes_per_s: float
    downlink_bytes_per_s: float
    latency_s: float
    step_seconds: dict[float, float] | None = None
    """Device time (set by the coordinator, which has the cost model): level -> seconds of one step."""
    compute: ComputeSpec | None = None
    """With ``step_seconds``: the profile's compute numbers, reported in ``hello`` instead of the host's."""
    peak_bytes: dict[float, int] | None = None
    """Level -> the cost model's predicted peak memory of a round (memory held by accounting, accounting.py)."""

    def as_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "profile": self.profile,
            "threads": self.threads,
            "memory_bytes": self.memory_bytes,
            "slowdown": self.slowdown,
            "uplink_bytes_per_s": self.uplink_bytes_per_s,
            "downlink_bytes_per_s": self.downlink_bytes_per_s,
            "latency_s": self.latency_s,
        }
        if self.step_seconds is not None:
            config["step_seconds"] = {float(level): float(s) for level, s in sorted(self.step_seconds.items())}
        if self.compute is not None:
            config["compute"] = self.compute.model_dump()
        if self.peak_bytes is not None:
            config["peak_bytes"] = {float(level): int(n) for level, n in sorted(self.peak_bytes.items())}
        return config


@dataclass(frozen=True)
class DataShare:
    """One device's share of a data set: shard ``index`` of ``count`` under ``partition`` with ``seed``."""

    dataset: str
    partition: str
    seed: int
    index: int
    count: int
    path: str | None = None
    samples: int | None = None
    """At most this many training samples of the shard (fleet.yaml's samples_per_device or overrides.samples)."""
    test_samples: int | None = None
    """At most this many test samples of the shard (fleet.yaml's evaluation.max_samples)."""

    def as_config(self) -> dict[str, Any]:
        config = {
            "dataset": self.dataset,
            "path": self.path,
            "partition": self.partition,
            "seed": self.seed,
            "index": self.index,
            "count": self.count,
        }
        sizes = {"samples": self.samples, "test_samples": self.test_samples}
        return config | {key: value for key, value in sizes.items() if value is not None}


def read_profile(path: Path) -> ProfileSpec:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise EmulationError(f"cannot read profile {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise EmulationError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise EmulationError(f"{path}: expected a mapping of profile settings")
    try:
        return ProfileSpec.model_validate(data)
    except ValidationError as exc:
        raise EmulationError(f"{path}: {describe(exc)}") from None


def find_profile(name_or_path: str, extra_dirs: Iterable[Path] = ()) -> ProfileSpec:
    """A profile by name (the file's ``name:``, later folders winning) or by the path of its YAML file."""
    if name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path:
        return read_profile(Path(name_or_path))
    found: dict[str, ProfileSpec] = {}
    for folder in profile_dirs(extra_dirs):
        try:
            paths = profile_files(folder)
        except NotADirectoryError as exc:
            raise EmulationError(str(exc)) from None
        for path in paths:
            profile = read_profile(path)
            found[profile.name] = profile
    if name_or_path not in found:
        close = difflib.get_close_matches(name_or_path, list(found), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known profiles: {', '.join(sorted(found)) or 'none'}"
        raise EmulationError(f"unknown profile {name_or_path!r} ({hint})")
    return found[name_or_path]


def measure_host_gflops(threads: int = 1, device: str = "cpu", seconds: float = 0.5) -> float:
    """fp32 matmul throughput one agent process gets here, with ``threads`` torch threads.

    Measured once per emulation, before any agent starts, and restored afterwards: the emulated
    devices' slowdowns are all relative to this one number.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure_matmul_gflops(resolve_device(device), seconds)
    finally:
        torch.set_num_threads(previous)


def limits_for(profile: ProfileSpec, host_gflops: float, threads: int = 1) -> EmulationLimits:
    """The limits that make an agent on this host behave like ``profile``.

    Memory is what the profile leaves for training (total - reserved); the slowdown is host /
    profile throughput (never below 1: a device faster than the host runs at host speed); link
    rates are the profile's Mbit/s in bytes/s, latency one way in seconds.
    """
    if threads < 1:
        raise EmulationError(f"threads must be >= 1, got {threads}")
    return EmulationLimits(
        profile=profile.name,
        threads=threads,
        memory_bytes=profile.memory.usable_bytes,
        slowdown=slowdown_factor(host_gflops, profile.compute.fp32_gflops),
        uplink_bytes_per_s=profile.network.uplink_mbps * 1e6 / 8,
        downlink_bytes_per_s=profile.network.downlink_mbps * 1e6 / 8,
        latency_s=profile.network.latency_ms / 1e3,
    )


EMULATED_KEEPALIVE_S = 120
"""An emulated agent's MQTT keepalive. Its host, not its link, is what may keep it silent: at the start of
round 1 a 2-core host running 1,000 Fashion-MNIST devices starved its workers' network threads past the
default 30 s (x1.5): the workers logged 521 disconnects in that round, each reconnect a TLS handshake and a
download started over."""


def agent_config(
    device: str,
    fleet: str,
    broker_url: str,
    data: DataShare,
    state_dir: Path,
    limits: EmulationLimits | None,
    *,
    password: str = f"env:{PASSWORD_ENV}",
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    protocol: str = "5",
    device_type: str = "cpu",
) -> dict[str, Any]:
    """One agent.yaml as a mapping (see agent_config.md); ``password`` is a reference, never the secret."""
    broker = {
        "url": broker_url,
        "password": password,
        "ca_file": ca_file,
        "protocol": protocol,
        "keepalive_s": EMULATED_KEEPALIVE_S,
    }
    if cert_file is not None:
        broker |= {"cert_file": cert_file, "key_file": key_file}
    return {
        "device": device,
        "fleet": fleet,
        "transport": {"broker": broker},
        "data": data.as_config(),
        "device_type": device_type,
        "state_dir": str(state_dir),
        "emulation": None if limits is None else limits.as_config(),
    }


def write_agent_config(path: Path, config: dict[str, Any]) -> Path:
    """Check ``config`` against the agent's own schema, then write it as YAML, atomically.

    Checking here turns a bad setting into one error at launch rather than N agents dying on start-up.
    The file holds no secret, only the password's reference.
    """
    parse_config(config, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, yaml.safe_dump(config, sort_keys=False).encode())
    return path
