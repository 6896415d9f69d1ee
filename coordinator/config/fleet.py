"""fleet.yaml: one file that says which devices train what, how, and where they meet.

Validation is strict and every error names its key path (``devices[3].profile: unknown profile
'jetson-nanoo' (did you mean 'jetson-nano'?)``): a typo found when the file is read costs a
second, one found in round 40 costs the run. See examples/fleet.yaml for a commented reference.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from copy import copy
from difflib import get_close_matches
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from coordinator.config.asynchronous import AsyncSettings, async_problem
from coordinator.config.checkpoints import Retention
from coordinator.config.evaluation import EvaluationSettings
from coordinator.config.limits import FleetLimits
from coordinator.config.logins import COORDINATOR_USER
from coordinator.config.secure import SecureAggregation, round_size
from coordinator.privacy.settings import PrivacySettings
from coordinator.privacy.support import privacy_problem
from coordinator.strategies import STRATEGIES, ModelSpec
from coordinator.strategies.presets import apply_preset, preset_for
from device_agent.clients.spec import TrainConfig
from device_agent.common.names import DatasetName
from device_agent.common.paths import anchor_keys
from device_agent.common.profile import ComputeSpec, MemorySpec, NetworkSpec
from device_agent.common.schema import DeviceName, FleetName, Partition, check_secret_ref
from device_agent.common.validation import describe, with_hints
from device_agent.models import MODELS, model_card
from device_agent.wire.guard import InboundLimits
from export.auto import ExportSettings
from profiles.catalog import Catalog, ProfileError, load_catalog, unknown_profile_message
from profiles.costmodel import OPTIMIZER_STATES

log = logging.getLogger(__name__)

REPORTED = "reported"
# Training-set sizes of the built-in datasets, to split across devices when no size is given.
DATASET_SIZES = {"digits": 1797, "fashion_mnist": 60_000, "cifar10": 50_000, "cifar100": 50_000}


class FleetError(ValueError):
    """fleet.yaml cannot be used; one line per problem, each starting with its key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def parse_ratio(value: Any) -> float:
    """A rank ratio from a number or a fraction string ('1/4'); must lie in (0, 1]."""
    if isinstance(value, bool):
        raise ValueError(f"rank ratio must be a number, got {value!r}")
    try:
        ratio = float(Fraction(str(value).strip())) if isinstance(value, str) else float(value)
    except (TypeError, ValueError, ZeroDivisionError):
        raise ValueError(f"rank ratio {value!r} is not a number (use e.g. 0.25 or 1/4)") from None
    if not 0 < ratio <= 1:
        raise ValueError(f"rank ratio {value} is outside (0, 1]")
    return ratio


class Broker(_Strict):
    """Where devices and coordinator meet. managed: a mosquitto the coordinator starts; amqtt: the pure-Python
    development fallback; external: an existing broker (cluster) by URL."""

    mode: Literal["managed", "amqtt", "external"] = Field(
        "managed",
        description="managed: the coordinator runs mosquitto; amqtt: pure-Python dev fallback; external: by url",
    )
    host: str = Field("0.0.0.0", description="where a managed broker listens")
    port: int = Field(None, ge=1, le=65535, description="default 8883 with tls, 1883 without")  # type: ignore[assignment]
    # Provisioning (`coordinator provision`): devices verify the broker and show it a client certificate.
    tls: bool = Field(True, description="managed mosquitto: TLS listener, CA and certificates from the kits")
    plain_port: int | None = Field(None, ge=1, le=65535, description="also a plain TCP listener (only when asked)")
    hosts: list[str] = Field(
        default_factory=list, description="names/IPs devices use to reach the broker (server certificate SANs)"
    )
    url: str | None = Field(None, description="external broker: mqtt://host:port or mqtts://host:port")
    ca_file: Path | None = Field(None, description="CA file that signed an external mqtts:// broker's certificate")
    username: str = Field(COORDINATOR_USER, description="the coordinator's login on an external broker")
    password: str | None = Field(None, description="the coordinator's password as a reference: env:NAME or file:PATH")

    @field_validator("password")
    @classmethod
    def _password_is_a_reference(cls, value: str | None) -> str | None:
        return check_secret_ref(value)

    @model_validator(mode="after")
    def _url_matches_mode(self) -> Broker:
        if self.mode == "external":
            if not self.url:
                raise ValueError("mode external needs url: mqtt://host:port or mqtts://host:port")
            if not re.match(r"^mqtts?://[^/:]+(:\d{1,5})?/?$", self.url):
                raise ValueError(f"url {self.url!r} must look like mqtt://host:port or mqtts://host:port")
        elif self.url:
            raise ValueError(f"url is only for mode external (mode is {self.mode}); set host/port instead")
        if self.ca_file is not None and not (self.url or "").startswith("mqtts://"):
            raise ValueError("ca_file only applies to an external mqtts:// broker")
        if self.port is None:
            self.port = 8883 if self.tls and self.mode == "managed" else 1883
        if self.mode != "external" and self.username != COORDINATOR_USER:
            raise ValueError(
                f"username {self.username!r} only applies to an external broker; a {self.mode} broker's "
                f"password file and ACL name the coordinator {COORDINATOR_USER!r}: leave username out"
            )
        if self.mode == "amqtt" and self.tls:
            self.tls = False  # amqtt has no TLS here: the development fallback stays plain
        return self


class ModelConfig(_Strict):
    arch: str = Field("resnet18", description=f"one of: {', '.join(sorted(MODELS))}")
    num_classes: PositiveInt = Field(10, description="output classes")
    in_channels: PositiveInt | None = Field(None, description="input channels; default: the data set's")
    image_size: int | None = Field(
        None, ge=8, description="input height and width; default: the data set's (a ViT's own size for ViT cards)"
    )

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, arch: str) -> str:
        if arch not in MODELS:
            raise ValueError(f"unknown model {arch!r}; choose one of: {', '.join(sorted(MODELS))}")
        return arch


class Dataset(_Strict):
    name: DatasetName = Field(
        "cifar10",
        description="digits and fashion_mnist are built in (scikit-learn; Debian's dataset-fashion-mnist); "
        "cifar10, cifar100, image_folder and npz read dataset.path",
    )
    path: Path | None = Field(
        None,
        description="where the data lies; needed by all but digits and fashion_mnist (an idx folder for fashion_mnist)",
    )
    partition: Partition = Field(
        Partition(kind="iid"),
        description="how emulated devices split the data (agent.yaml's data.partition reads the same)",
    )
    seed: int = Field(0, description="seed of the split and of each round's per-device training seed")
    samples_per_device: PositiveInt | None = Field(
        None, description="local training samples per device; default: the dataset's size split evenly"
    )

    @model_validator(mode="after")
    def _path_and_size(self) -> Dataset:
        if self.name in {"image_folder", "npz"}:
            if self.path is None:
                raise ValueError(f"dataset {self.name} needs a path")
            if self.samples_per_device is None:
                raise ValueError(f"dataset {self.name} needs samples_per_device (its size is not known in advance)")
        return self


class Strategy(_Strict):
    """The strategy by registry name; ``params`` are checked by that strategy's own ``Params`` schema."""

    name: str = Field("fedhm", description=f"one of: {', '.join(STRATEGIES)}")
    preset: str | None = Field(
        None, description="'paper': the paper's training recipe as defaults (docs/presets.md); explicit keys win"
    )
    params: dict[str, Any] = Field(default_factory=dict, description="checked by the strategy's own Params schema")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: rounds; async: FedBuff, every device trains on the newest model (docs/async.md)"
    )
    asynchronous: AsyncSettings | None = Field(
        None, alias="async", description="mode async: the buffer, server learning rate and bounds (docs/async.md)"
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _async_settings_need_async_mode(self) -> Strategy:
        if self.asynchronous is not None and self.mode != "async":
            raise ValueError("async: only applies with `mode: async` (mode is 'sync'); add it or drop the section")
        if self.mode == "async" and self.asynchronous is None:
            self.asynchronous = AsyncSettings()
        return self

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
        return name

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str | None, info: ValidationInfo) -> str | None:
        if preset is not None and "name" in info.data:
            preset_for(preset, info.data["name"])
        return preset

    @field_validator("params")
    @classmethod
    def _params_for_strategy(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        strategy = STRATEGIES.get(info.data.get("name", ""))
        if strategy is None:
            return params
        try:
            return strategy.Params.model_validate(params).model_dump()
        except ValidationError as exc:
            raise with_hints(exc, strategy.Params) from None


class Training(_Strict):
    """Local training on every device; each option reaches the device in its assignment's ``train``."""

    batch_size: PositiveInt = Field(32, description="local batch size")
    local_epochs: PositiveInt = Field(1, description="passes over the local data per round")
    lr: PositiveFloat = Field(0.05, description="learning rate")
    optimizer: Literal[tuple(OPTIMIZER_STATES)] = Field("momentum", description="local optimizer")  # type: ignore[valid-type]
    momentum: float | None = Field(
        None, ge=0, lt=1, description="heavy-ball momentum of the 'momentum' optimizer (default 0.9)"
    )
    weight_decay: float = Field(5e-4, ge=0, description="L2 on dense parameters (FedHM factors: frobenius_decay)")
    mask_absent_classes: bool = Field(True, description="mask logits of classes a device has no sample of")
    absent_class_fill: Literal["-inf", "zero"] = Field(
        "-inf",
        description="what masked logits become: -inf (out of the softmax; a one-class device learns nothing) "
        "or zero (HeteroFL/FedHM reference code, the FedLoRA paper's extreme non-IID setting)",
    )

    @model_validator(mode="after")
    def _momentum_needs_its_optimizer(self) -> Training:
        if self.momentum is not None and self.optimizer != "momentum":
            raise ValueError(f"momentum only applies to optimizer 'momentum' (optimizer is {self.optimizer!r})")
        return self

    def for_device(self, device: Device, seed: int) -> TrainConfig:
        """What ``device`` trains with this round: the fleet's settings, its overrides, the round's seed."""
        return TrainConfig(
            optimizer=self.optimizer,
            lr=self.lr,
            momentum=(0.9 if self.momentum is None else self.momentum) if self.optimizer == "momentum" else 0.0,
            weight_decay=self.weight_decay,
            epochs=device.overrides.local_epochs or self.local_epochs,
            batch_size=device.overrides.batch_size or self.batch_size,
            seed=seed,
            mask_absent_classes=self.mask_absent_classes,
            absent_class_fill=self.absent_class_fill,
        )


class Transport(BaseModel):
    """How the coordinator reaches its devices: the engine's Link (``coordinator.transport.link``).

    ``kind`` names a registered transport; ``broker`` is the MQTT transport's. A transport from a plugin reads
    its own keys beside them: they are checked by that transport (``Transport.settings`` in the registry)
    when ``coordinator start`` or ``simulate()`` picks it, not here, where only the built-in keys are known.
    """

    model_config = ConfigDict(extra="allow")

    kind: str = Field(
        "mqtt",
        pattern=r"^[a-z][a-z0-9_-]*$",
        description="a registered transport (coordinator.transport.registry; plugins add more): mqtt, devices are "
        "agents on the broker (coordinator start); in_process, devices are agents on threads of this process, "
        "over memory, with their data in memory, which only simulate() sets up; websocket, devices are agents on a "
        "WebSocket over TLS to the coordinator (networks that pass only HTTPS)",
    )
    broker: Broker = Field(default_factory=Broker, description="mqtt: where devices and coordinator meet")

    @property
    def options(self) -> dict[str, Any]:
        """The keys beside ``kind`` and ``broker``: a plugin transport's own settings."""
        return dict(self.model_extra or {})

    @model_validator(mode="before")
    @classmethod
    def _no_misspelt_keys(cls, data: Any) -> Any:
        """A key close to ``kind`` or ``broker`` is a typo (it would leave the default in place), not a kind's
        setting."""
        if isinstance(data, dict):
            built_in = list(_TransportKeys.model_fields)
            typos = {
                k: v for k, v in data.items() if k not in built_in and get_close_matches(str(k), built_in, cutoff=0.6)
            }
            if typos:
                _TransportKeys.model_validate(typos)  # raises extra_forbidden at each such key
        return data


class _TransportKeys(_Strict):
    kind: str = "mqtt"
    broker: dict[str, Any] | None = None


class Planning(_Strict):
    memory_safety_factor: float = Field(
        1.25, ge=1, description="predicted peak memory times this must fit in the device's usable memory"
    )


class Security(_Strict):
    sign_uploads: bool = Field(
        False,
        description="every update must carry its device's HMAC-SHA256 signature (keys made by coordinator provision)",
    )


def _partial(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with every field optional (constraints kept): a patch over a profile section."""
    fields: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        optional = copy(info)
        optional.default = None
        fields[name] = (info.annotation | None, optional)
    return create_model(f"{model.__name__}Override", __config__=ConfigDict(extra="forbid"), **fields)


MemoryOverride = _partial(MemorySpec)
ComputeOverride = _partial(ComputeSpec)
NetworkOverride = _partial(NetworkSpec)


class DeviceOverrides(_Strict):
    """Per-device corrections: a bigger batch for one box, a known-slow link, a smaller local dataset..."""

    batch_size: PositiveInt | None = Field(None, description="this device's batch size")
    local_epochs: PositiveInt | None = Field(None, description="this device's local epochs")
    samples: PositiveInt | None = Field(None, description="this device's local samples, for planning")
    max_ratio: float | None = Field(None, description="the largest level this device may get (e.g. 1/2)")
    memory: MemoryOverride | None = Field(None, description="patch over the profile's memory")  # type: ignore[valid-type]
    compute: ComputeOverride | None = Field(None, description="patch over the profile's compute")  # type: ignore[valid-type]
    network: NetworkOverride | None = Field(None, description="patch over the profile's network")  # type: ignore[valid-type]

    @field_validator("max_ratio", mode="before")
    @classmethod
    def _ratio(cls, value: Any) -> float | None:
        return None if value is None else parse_ratio(value)


class Device(_Strict):
    id: DeviceName = Field(description="device name, also its broker login and topic level")
    profile: str = Field(
        description=f"a device class (`coordinator profiles`) or {REPORTED!r}: what the device measures"
    )
    credentials: str | None = Field(None, description="env:NAME or file:PATH; generated at provisioning when absent")
    overrides: DeviceOverrides = Field(DeviceOverrides(), description="per-device corrections")

    @field_validator("credentials")
    @classmethod
    def _credentials_are_a_reference(cls, value: str | None) -> str | None:
        return check_secret_ref(value)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, name: str, info: ValidationInfo) -> str:
        profiles = (info.context or {}).get("profiles")
        if name != REPORTED and profiles is not None and name not in profiles:
            raise ValueError(unknown_profile_message(name, [*profiles, REPORTED]))
        return name

    @model_validator(mode="after")
    def _overrides_fit_the_profile(self, info: ValidationInfo) -> Device:
        profiles = (info.context or {}).get("profiles")
        if profiles is None or self.profile not in profiles:
            return self
        for section in ("memory", "compute", "network"):
            patch = getattr(self.overrides, section)
            if patch is not None:
                base = getattr(profiles[self.profile], section)
                try:
                    base.model_validate({**base.model_dump(), **patch.model_dump(exclude_none=True)})
                except ValidationError as exc:
                    raise ValueError(describe(exc, prefix=f"overrides.{section}", model=type(base))) from None
        return self


class Fleet(_Strict):
    """The whole fleet.yaml."""

    fleet: FleetName = Field(description="fleet name (an MQTT topic level)")
    model: ModelConfig = Field(ModelConfig(), description="the global model")
    dataset: Dataset = Field(Dataset(), description="the data and how emulated devices split it")
    strategy: Strategy = Field(Strategy(), description="the federated algorithm and its parameters")
    ratios: list[float] = Field(
        [1.0, 0.5, 0.25, 0.125],
        min_length=1,
        description="levels in (0, 1]: FedHM's rank ratio, HeteroFL's width; [1] for strategies without levels",
    )
    rounds: PositiveInt = Field(100, description="rounds to run")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of planned devices asked per round")
    round_deadline_s: PositiveFloat = Field(600.0, description="seconds a round waits for its answers")
    quorum: float = Field(
        0.8, gt=0, le=1, description="fraction of asked devices whose accepted updates a round needs at its deadline"
    )
    on_quorum_miss: Literal["extend", "skip", "retry"] = Field(
        "extend",
        description="at the deadline below quorum: extend once by round_deadline_s; skip the round; or retry it: "
        "send every participant without an accepted update its assignment again and wait round_deadline_s more, "
        "up to quorum_retries times (accepted updates are kept: nothing was folded, so they still fit)",
    )
    quorum_retries: PositiveInt = Field(2, description="on_quorum_miss: retry: the most times a round is retried")
    training: Training = Field(Training(), description="local training, the same on every device unless overridden")
    planning: Planning = Field(Planning(), description="how levels are chosen")
    transport: Transport = Field(default_factory=Transport, description="how the coordinator reaches its devices")
    security: Security = Field(Security(), description="upload signatures")
    profile_dirs: list[Path] = Field(
        default_factory=list, description="extra profile directories (relative: to this file)"
    )
    devices: list[Device] = Field(min_length=1, description="the fleet's devices, at least one")
    export: ExportSettings | None = Field(None, description="ONNX exports written when the run finishes")
    checkpoints: Retention = Field(default_factory=Retention, description="which round states the run keeps")
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="where the global model is evaluated each round"
    )
    limits: FleetLimits = Field(
        default_factory=FleetLimits, description="what the coordinator accepts from each device, how long it waits"
    )
    privacy: PrivacySettings | None = Field(
        None, description="user-level differential privacy (DP-FedAvg): clipping, noise, accountant, budget"
    )
    secure_aggregation: SecureAggregation | None = Field(
        None, description="SecAgg+: the coordinator learns only the sum of a round's updates (FedAvg only)"
    )

    @property
    def broker(self) -> Broker:
        """The MQTT broker's settings (``transport.broker``)."""
        return self.transport.broker

    def inbound_limits(self) -> InboundLimits:
        """The transport guard's bounds on each device, sized to the largest model the strategy sends or takes
        back (a device masks values of up to 8 bytes under secure aggregation) unless ``limits`` says."""
        cls = STRATEGIES[self.strategy.name]
        params = cls.Params.model_validate(self.strategy.params)
        card = model_card(self.model.arch)
        spec = ModelSpec(
            self.model.arch,
            self.model.num_classes,
            self.model.in_channels or card.in_channels,
            self.model.image_size or card.image_size,
        )
        largest = max(cls.upload_bytes(spec, params, 1.0), cls.download_bytes(spec, params, 1.0))
        return self.limits.inbound(largest * (2 if self.secure_aggregation is not None else 1))

    def with_broker(self, broker: Broker) -> Fleet:
        """A copy on another broker (``model_copy(update={"broker": ...})`` would not reach a property)."""
        return self.model_copy(update={"transport": self.transport.model_copy(update={"broker": broker})})

    @model_validator(mode="before")
    @classmethod
    def _broker_under_transport(cls, data: Any) -> Any:
        """Files from before 0.9 have ``broker:`` at the top level: still read, with a line saying how to move it."""
        if not isinstance(data, dict) or "broker" not in data:
            return data
        transport = data.get("transport", {})
        if not isinstance(transport, dict):
            return data
        if "broker" in transport:
            raise ValueError("broker: given twice, at the top level and as transport.broker; keep transport.broker")
        log.warning(
            "fleet.yaml: the top-level `broker:` section is now `transport.broker:`; move it under `transport:` "
            "(indent it and add `transport:` above it); this file is read as if it had been moved"
        )
        moved = {key: value for key, value in data.items() if key != "broker"}
        return {**moved, "transport": {**transport, "broker": data["broker"]}}

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """Fill ``training`` and ``strategy.params`` from ``strategy.preset``; a bad preset is reported at its key."""
        strategy = data.get("strategy") if isinstance(data, dict) else None
        if not isinstance(strategy, dict) or strategy.get("preset") is None:
            return data
        try:
            preset = preset_for(strategy["preset"], strategy.get("name", "fedhm"))
        except (TypeError, ValueError):
            return data
        training, params = data.get("training", {}), strategy.get("params", {})
        if not isinstance(training, dict) or not isinstance(params, dict):
            return data
        training, params = apply_preset(preset, training, params)
        return {**data, "training": training, "strategy": {**strategy, "params": params}}

    @field_validator("ratios", mode="before")
    @classmethod
    def _parse_ratios(cls, values: Any) -> Any:
        if not isinstance(values, list):
            return values
        ratios = [parse_ratio(v) for v in values]
        if len(set(ratios)) != len(ratios):
            raise ValueError(f"duplicate rank ratios in {values}")
        return sorted(ratios, reverse=True)

    @field_validator("devices")
    @classmethod
    def _unique_ids(cls, devices: list[Device]) -> list[Device]:
        seen: dict[str, int] = {}
        for index, device in enumerate(devices):
            if device.id in seen:
                raise ValueError(f"duplicate device id {device.id!r} (devices[{seen[device.id]}] and devices[{index}])")
            seen[device.id] = index
        return devices

    @model_validator(mode="after")
    def _ids_are_not_the_coordinators(self) -> Fleet:
        """A device named like the coordinator's login would get its password and its fleet-wide ACL."""
        reserved = {COORDINATOR_USER, self.broker.username}
        for index, device in enumerate(self.devices):
            if device.id in reserved:
                raise ValueError(
                    f"devices[{index}].id: {device.id!r} is the coordinator's broker login "
                    f"(reserved: {', '.join(sorted(reserved))}); rename the device"
                )
        return self

    @model_validator(mode="after")
    def _ratios_fit_the_strategy(self) -> Fleet:
        """A ratio means what the strategy makes of it; one with no size levels trains the whole model, ratio 1."""
        strategy = STRATEGIES[self.strategy.name]
        if not strategy.levels.sized and "ratios" not in self.model_fields_set:
            self.ratios = [1.0]
        for ratio in self.ratios:
            problem = strategy.level_problem(ratio)
            if problem is not None:
                hint = "write `ratios: [1]` or leave ratios out" if not strategy.levels.sized else "drop it"
                raise ValueError(
                    f"ratios: {ratio:g} does not fit strategy {strategy.name!r}: {problem}; {hint}"
                    f" (ratios are {', '.join(f'{r:g}' for r in self.ratios)})"
                )
        return self

    @model_validator(mode="after")
    def _max_ratios_allowed(self) -> Fleet:
        for index, device in enumerate(self.devices):
            cap = device.overrides.max_ratio
            if cap is not None and cap not in self.ratios:
                raise ValueError(
                    f"devices[{index}].overrides.max_ratio {cap} is not one of the allowed ratios {self.ratios}"
                )
        return self

    @model_validator(mode="after")
    def _export_fits(self) -> Fleet:
        if self.export is not None:
            strategy = STRATEGIES[self.strategy.name]
            ids = [d.id for d in self.devices]
            problems = self.export.problems(self.ratios, ids, strategy.personalized, strategy.levels.factorized)
            if problems:
                raise ValueError("export." + "; export.".join(problems))
        return self

    @model_validator(mode="after")
    def _privacy_fits(self) -> Fleet:
        """DP applies to strategies whose aggregate is one uniform sum; delta must be below 1 / devices."""
        if self.privacy is None:
            return self
        problem = privacy_problem(self.strategy.name, self.strategy.params)
        if problem is not None:
            raise ValueError(f"privacy: {problem}")
        if self.privacy.delta >= 1 / len(self.devices):
            raise ValueError(
                f"privacy.delta: {self.privacy.delta:g} is not below 1 / {len(self.devices)} devices: such a delta "
                "allows publishing one device's data outright; use e.g. 1e-5"
            )
        return self

    @model_validator(mode="after")
    def _async_fits(self) -> Fleet:
        """Async mode needs a strategy with one dense update space, and neither SecAgg nor DP (yet)."""
        if self.strategy.mode != "async":
            return self
        problem = async_problem(
            self.strategy.name, self.strategy.params, self.privacy is not None, self.secure_aggregation is not None
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _secure_aggregation_fits(self) -> Fleet:
        """Secure aggregation needs a sum strategy, no screening, no DP (yet), and parameters fit for a round."""
        if self.secure_aggregation is None:
            return self
        size = round_size(len(self.devices), self.participation)
        problems = self.secure_aggregation.problems(
            size,
            self.strategy.name,
            self.limits.model_dump(),
            self.privacy is not None,
            self.strategy.params,
            self.privacy is not None and self.privacy.clip.adaptive,
            self._device_noise(size),
        )
        if problems:
            raise ValueError("secure_aggregation: " + "; ".join(problems))
        return self

    def _device_noise(self, devices: int) -> float | None:
        """Under privacy with SecAgg, the std of the noise each of a round's devices adds (z C / sqrt(devices)), when
        fleet.yaml fixes both z and C."""
        privacy = self.privacy
        if privacy is None or privacy.noise_multiplier is None or privacy.clip.adaptive:
            return None
        return privacy.noise_multiplier * privacy.clip.first_norm / math.sqrt(devices)

    def sized_samples(self, device: Device) -> int | None:
        """The training samples fleet.yaml sizes ``device`` at, if it does: what its agent trains on."""
        if device.overrides.samples is None and self.dataset.samples_per_device is None:
            return None
        return self.samples_for(device)

    def samples_for(self, device: Device) -> int:
        if device.overrides.samples is not None:
            return device.overrides.samples
        if self.dataset.samples_per_device is not None:
            return self.dataset.samples_per_device
        return max(1, DATASET_SIZES[self.dataset.name] // len(self.devices))


def parse_fleet(data: Any, catalog: Mapping[str, Any] | None = None, source: str = "fleet.yaml") -> Fleet:
    """Validate already-loaded YAML; ``catalog`` (profile names) enables the profile checks."""
    if not isinstance(data, dict):
        raise FleetError(f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}")
    try:
        return Fleet.model_validate(data, context={"profiles": catalog})
    except ValidationError as exc:
        raise FleetError(f"{source}:\n" + describe(exc, sep="\n", model=Fleet)) from None


def anchor_file_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of a fleet.yaml mapping whose relative paths (data, CA, ``file:`` secrets) point into ``base``."""
    anchored = dict(data)
    for key in ("broker", "dataset", "transport"):
        if isinstance(anchored.get(key), dict):
            anchored[key] = dict(anchored[key])
    transport = anchored.get("transport")
    if isinstance(transport, dict) and isinstance(transport.get("broker"), dict):
        transport["broker"] = dict(transport["broker"])
        anchor_keys(transport["broker"], ("ca_file",), base, secrets=("password",))
    anchor_keys(anchored.get("broker"), ("ca_file",), base, secrets=("password",))
    anchor_keys(anchored.get("dataset"), ("path",), base)
    if isinstance(anchored.get("devices"), list):
        anchored["devices"] = [dict(d) if isinstance(d, dict) else d for d in anchored["devices"]]
        for device in anchored["devices"]:
            anchor_keys(device, (), base, secrets=("credentials",))
    return anchored


def load_fleet(path: Path | str) -> tuple[Fleet, Catalog]:
    """Read and validate a fleet.yaml, with the shipped profiles plus its ``profile_dirs``.

    Relative paths in the file (``dataset.path``, ``transport.broker.ca_file``, ``file:`` secrets, ``profile_dirs``)
    are relative to the file's folder, so the fleet means the same from any working directory.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise FleetError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise FleetError(f"{path}: not valid YAML: {exc}") from None
    if isinstance(data, dict):
        data = anchor_file_paths(data, path.resolve().parent)
    dirs = data.get("profile_dirs", []) if isinstance(data, dict) else []
    try:
        catalog = load_catalog([path.parent / Path(d) for d in dirs] if isinstance(dirs, list) else [])
    except ProfileError as exc:
        raise FleetError(f"{path}: profile_dirs: {exc}") from None
    return parse_fleet(data, catalog, str(path)), catalog
