"""agent.yaml: how one device agent joins a fleet, what data it trains on, how it is held to a profile.

The file never holds the broker password itself, only where to find it (``env:NAME`` or
``file:PATH``), so agent.yaml can be copied around, committed or baked into an image. Every field
has a default except ``device`` and ``fleet``; command-line flags override the file (see
``device_agent.cli.run``). A bad value is reported with its key path, e.g. ``data.partition``.
Relative paths in the file (``file:`` secrets, certificates, data, state dir) are relative to the file.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from device_agent.agent.signing import parse_key
from device_agent.common.names import DatasetName
from device_agent.common.paths import anchor_keys
from device_agent.common.profile import ComputeSpec
from device_agent.common.schema import (
    DeviceName,
    FleetName,
    SecretError,
    check_secret_ref,
    parse_partition,
    resolve_secret,
)
from device_agent.common.validation import describe
from device_agent.data.datasets import BUILT_IN, source_of
from device_agent.data.partition import PartitionSpec

log = logging.getLogger(__name__)

# Relative to agent.yaml's folder when read from a file, else to the working directory.
DEFAULT_STATE_DIR = "agent-state"


class ConfigError(ValueError):
    """agent.yaml (or a flag) that cannot be used; the message names the key path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _resolved(ref: str | None, key: str) -> str | None:
    """The secret ``ref`` points at (None without one); a missing variable or file is an error naming ``key``."""
    if ref is None:
        return None
    try:
        return resolve_secret(ref)
    except SecretError as exc:
        raise ConfigError(f"{key}: {exc}") from None


class DoctorLogin(_Section):
    """The device's read-only login for ``device-agent doctor`` (user ``doctor@<device>``, from its kit).

    Doctor asks the broker with it whether the device's agent is online anywhere before it logs in as
    the device, which would take over the agent's session.
    """

    password: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @field_validator("password")
    @classmethod
    def _reference(cls, ref: str | None) -> str | None:
        return check_secret_ref(ref)

    @model_validator(mode="after")
    def _client_certificate(self) -> DoctorLogin:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "transport.broker.doctor.cert_file and key_file go together (a client certificate and its key)"
            )
        return self

    def resolve_password(self) -> str | None:
        return _resolved(self.password, "transport.broker.doctor.password")


class BrokerConfig(_Section):
    url: str = "mqtt://127.0.0.1:1883"
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    protocol: Literal["5", "3.1.1"] = "5"
    doctor: DoctorLogin | None = None
    keepalive_s: int = Field(30, ge=5, le=3600)
    """MQTT keepalive: the broker drops a session it has heard nothing from in 1.5x this. Emulated agents get
    120 s (see :data:`device_agent.emulation.profile_config.EMULATED_KEEPALIVE_S`)."""

    @field_validator("url")
    @classmethod
    def _scheme(cls, url: str) -> str:
        if not url.startswith(("mqtt://", "mqtts://")):
            raise ValueError(f"must start with mqtt:// or mqtts://, got {url!r}")
        parts = urlsplit(url)
        if not parts.hostname:
            raise ValueError(f"{url!r} has no host (mqtt://host:port)")
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0:
            raise ValueError(f"{url!r}: the port must be a number from 1 to 65535")
        return url

    @model_validator(mode="after")
    def _client_certificate(self) -> BrokerConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (a client certificate and its key)")
        if self.cert_file is not None and not self.url.startswith("mqtts://"):
            raise ValueError("a client certificate (cert_file) needs an mqtts:// url")
        return self

    @field_validator("password")
    @classmethod
    def _reference(cls, ref: str | None) -> str | None:
        return check_secret_ref(ref)

    @field_validator("protocol", mode="before")
    @classmethod
    def _protocol_text(cls, value: Any) -> Any:
        # YAML reads an unquoted 5 as an int; accept it rather than make users quote it.
        return str(value) if isinstance(value, int | float) else value

    def resolve_password(self) -> str | None:
        """The secret the reference points at; a missing variable or file is an error naming it."""
        return _resolved(self.password, "transport.broker.password")


class TransportConfig(BaseModel):
    """How the agent reaches its coordinator: a port kind of :data:`device_agent.agent.ports.PORTS`.

    ``broker`` is what the ``mqtt`` kind connects to. Every other key besides ``kind`` is that kind's own
    setting (``model_extra``), which the kind checks at start (:meth:`device_agent.agent.ports.PortKind.problems`:
    ``mqtt`` takes none).
    """

    model_config = ConfigDict(extra="allow")

    kind: str = Field(
        "mqtt",
        pattern=r"^[a-z][a-z0-9_-]*$",
        description="a registered port kind (device_agent.agent.ports; a package adds one under the entry point "
        "group fedfleet.ports): mqtt, the device's MQTT session on broker:",
    )
    broker: BrokerConfig = Field(default_factory=BrokerConfig, description="mqtt: the broker and this device's login")


class DataConfig(_Section):
    dataset: DatasetName = "digits"
    path: str | None = None
    partition: str = "iid"
    seed: int = 0
    index: int | None = Field(default=None, ge=0)
    count: int | None = Field(default=None, ge=1)
    samples: int | None = Field(default=None, ge=1)
    """Train on at most this many samples of the share, drawn once with ``seed`` (an emulated device's size)."""
    test_samples: int | None = Field(default=None, ge=1)
    """Evaluate on at most this many test samples of the share, drawn once with ``seed`` (fleet.yaml's
    ``evaluation.max_samples``: the device's evaluation before and after training costs as much as asked)."""

    @field_validator("partition")
    @classmethod
    def _partition_syntax(cls, value: str) -> str:
        return parse_partition(value).text

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.dataset not in BUILT_IN and self.path is None:
            raise ValueError(f"dataset {self.dataset!r} needs data.path (a folder or file on this device)")
        if (self.index is None) != (self.count is None):
            raise ValueError("data.index and data.count go together (this device's share of `count` shares)")
        if self.index is not None and self.count is not None and self.index >= self.count:
            raise ValueError(f"data.index must be < data.count={self.count}, got {self.index}")
        return self

    @property
    def source(self) -> str:
        """What ``device_agent.data.datasets.load_dataset`` reads."""
        return source_of(self.dataset, self.path)

    def partition_spec(self) -> PartitionSpec | None:
        """The split this device takes one share of; None when all local data is this device's."""
        if self.index is None or self.count is None:
            return None
        return parse_partition(self.partition).spec(self.count, self.seed)


class EmulationConfig(_Section):
    """How an emulated agent is held to its profile (written by ``coordinator emulate``, see limits.py).

    Compute pace, one of: ``step_seconds`` (device time: each training step at level L lasts at least
    ``step_seconds[L]``, the cost model's prediction for the profile, computed by the coordinator since
    the agent does not carry the cost model) or ``slowdown`` (each step stretched to that many times
    its host duration). ``compute`` is the profile's compute section, reported in ``hello`` in place
    of the host's measurement so that the planner predicts with the numbers the device is held to.
    ``peak_bytes`` (level -> bytes) is the cost model's predicted peak memory of a round at that level:
    a round whose level needs more than ``memory_bytes`` fails with out_of_memory (see accounting.py).
    """

    profile: str | None = None
    threads: int | None = Field(default=None, ge=1)
    memory_bytes: int | None = Field(default=None, gt=0)
    slowdown: float = Field(default=1.0, ge=1.0)
    step_seconds: dict[float, Annotated[float, Field(gt=0)]] | None = None
    peak_bytes: dict[float, Annotated[int, Field(gt=0)]] | None = None
    compute: ComputeSpec | None = None
    uplink_bytes_per_s: float | None = Field(default=None, gt=0)
    downlink_bytes_per_s: float | None = Field(default=None, gt=0)
    latency_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _one_pace(self) -> EmulationConfig:
        if self.step_seconds is not None and self.slowdown != 1.0:
            raise ValueError("step_seconds (device time) and slowdown (host ratio) exclude each other; set one")
        return self


class AgentConfig(_Section):
    device: DeviceName
    fleet: FleetName
    transport: TransportConfig = Field(default_factory=TransportConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    device_type: str = "auto"
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    emulation: EmulationConfig | None = None
    # Not in the lead's sample file: how often the agent refreshes its retained status (seconds).
    heartbeat_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="give up (exit 1) if the broker cannot be reached, or the TLS handshake or login does not "
        "succeed, this long at start-up",
    )

    # Where this device's upload-signing key is (env:/file:); set when the fleet has security.sign_uploads.
    signing_key: str | None = None

    @property
    def broker(self) -> BrokerConfig:
        """The MQTT broker and this device's login (``transport.broker``)."""
        return self.transport.broker

    @model_validator(mode="before")
    @classmethod
    def _broker_under_transport(cls, data: Any) -> Any:
        """agent.yaml files from before 0.9 (every kit in the field) have ``broker:`` at the top level: read it as
        ``transport.broker``, with a line saying how to move it; keys under ``transport.broker`` (flags) win."""
        if not isinstance(data, dict) or not isinstance(data.get("broker"), dict):
            return data
        transport = data.get("transport", {})
        if not isinstance(transport, dict):
            return data
        log.warning(
            "agent.yaml: the top-level `broker:` section is now `transport.broker:`; move it under `transport:` "
            "(indent it and add `transport:` above it); this file is read as if it had been moved"
        )
        moved = {key: value for key, value in data.items() if key != "broker"}
        given = transport.get("broker")
        broker = {**data["broker"], **(given if isinstance(given, dict) else {})}
        return {**moved, "transport": {**transport, "broker": broker}}

    @field_validator("signing_key")
    @classmethod
    def _signing_key_reference(cls, ref: str | None) -> str | None:
        return check_secret_ref(ref)

    def resolve_signing_key(self) -> bytes | None:
        """The key the reference points at; an unset or unreadable one is an error naming it."""
        if self.signing_key is None:
            return None
        try:
            return parse_key(resolve_secret(self.signing_key), self.signing_key)
        except ValueError as exc:  # SecretError included
            raise ConfigError(f"signing_key: {exc}") from None

    @field_validator("device_type")
    @classmethod
    def _device_type(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", value):
            raise ValueError(f"expected auto, cpu, cuda, cuda:N or mps, got {value!r}")
        return value


def parse_config(raw: dict[str, Any], where: str = "agent config") -> AgentConfig:
    """Validate a mapping (from YAML and/or flags) into an AgentConfig, or ``ConfigError`` with key paths."""
    try:
        return AgentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {describe(exc, empty='<file>', model=AgentConfig)}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw mapping of an agent.yaml; flags are merged into it before validation."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (device, fleet, broker, ...), got {type(raw).__name__}")
    return raw


def load_config(path: Path, overrides: dict[str, Any] | None = None) -> AgentConfig:
    """agent.yaml with ``overrides`` (dotted keys, e.g. ``{"transport.broker.url": ...}``) applied on top.

    The file's relative paths (and the default state dir) are anchored at the file's folder;
    the overrides, being flags, stay relative to the working directory.
    """
    raw = anchor_file_paths(read_config_file(path), Path(path).resolve().parent)
    return parse_config(merge_overrides(raw, overrides or {}), str(path))


KIT_CONFIG = "agent.yaml"
KIT_STATE_DIR = "state"


def load_kit(folder: Path, overrides: dict[str, Any] | None = None) -> AgentConfig:
    """The agent.yaml of an unpacked kit, run where it lies rather than installed.

    A kit's agent.yaml names the paths ``install.sh`` copies its files to (``/opt/fedfleet/etc/...``,
    state in ``/var/lib/fedfleet``). Here each certificate, key and ``file:`` secret is taken from the kit
    folder instead when the kit holds a file of that name (a reference to a file the kit does not carry
    is kept as written), the state dir defaults to ``FOLDER/state``, and a data path inside the
    installed state dir moves with it. Relative paths are relative to the folder, as in any agent.yaml.
    """
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(f"--kit {folder}: not a folder (unpack the kit first: tar xzf DEVICE.tar.gz)")
    path = folder / KIT_CONFIG
    raw = read_config_file(path)
    state = folder / KIT_STATE_DIR
    installed_state = raw.get("state_dir")
    raw["state_dir"] = str(state)
    for section in _login_sections(raw):  # a port kind's own TLS files and login are where broker's are
        for key in ("ca_file", "cert_file", "key_file"):
            if key in section:
                section[key] = _in_kit(section[key], folder)
        if "password" in section:
            section["password"] = _secret_in_kit(section["password"], folder)
    for broker in _broker_sections(raw):
        doctor = broker.get("doctor")
        if isinstance(doctor, dict):
            for key in ("cert_file", "key_file"):
                doctor[key] = _in_kit(doctor.get(key), folder)
            doctor["password"] = _secret_in_kit(doctor.get("password"), folder)
    raw["signing_key"] = _secret_in_kit(raw.get("signing_key"), folder)
    data = raw.get("data")
    if isinstance(data, dict) and isinstance(data.get("path"), str) and isinstance(installed_state, str):
        inside = Path(data["path"])
        if inside.is_absolute() and inside.is_relative_to(installed_state):
            data["path"] = str(state / inside.relative_to(installed_state))
    raw = {key: value for key, value in raw.items() if value is not None}
    return parse_config(merge_overrides(anchor_file_paths(raw, folder), overrides or {}), str(path))


def _broker_sections(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The broker sections of a raw agent.yaml: ``transport.broker``, and a top-level ``broker`` of an older file."""
    transport = raw.get("transport")
    candidates = [raw.get("broker"), transport.get("broker") if isinstance(transport, dict) else None]
    return [section for section in candidates if isinstance(section, dict)]


def _login_sections(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Every section that may name TLS files and a password: the broker's and the port kind's own."""
    transport = raw.get("transport")
    return [*_broker_sections(raw), *([transport] if isinstance(transport, dict) else [])]


def _in_kit(value: Any, folder: Path) -> Any:
    """``folder/NAME`` for an installed path whose file NAME the kit holds; anything else unchanged."""
    if isinstance(value, str) and value and (folder / Path(value).name).is_file():
        return str(folder / Path(value).name)
    return value


def _secret_in_kit(ref: Any, folder: Path) -> Any:
    if isinstance(ref, str) and ref.startswith("file:"):
        return f"file:{_in_kit(ref.removeprefix('file:'), folder)}"
    return ref


def anchor_file_paths(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of an agent.yaml mapping whose relative paths point into ``base``."""
    anchored = copy.deepcopy(raw)
    anchored.setdefault("state_dir", DEFAULT_STATE_DIR)
    anchor_keys(anchored, ("state_dir",), base)
    for section in _login_sections(anchored):
        anchor_keys(section, ("ca_file", "cert_file", "key_file"), base, secrets=("password",))
    for broker in _broker_sections(anchored):
        if isinstance(broker.get("doctor"), dict):
            anchor_keys(broker["doctor"], ("cert_file", "key_file"), base, secrets=("password",))
    anchor_keys(anchored.get("data"), ("path",), base)
    return anchored


def merge_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``raw`` with each dotted key of ``overrides`` set (None values are skipped)."""
    merged: dict[str, Any] = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    for dotted, value in overrides.items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        node = merged
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return merged
