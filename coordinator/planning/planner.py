"""Per-device levels: the largest allowed ratio whose model fits a device's memory and the round deadline.

What a level means is the strategy's business: a FedHM rank ratio gamma, a HeteroFL width rate, or
nothing (Factorized-FL trains the whole model everywhere). Each candidate level is sized with the
model the fleet's strategy really sends at that level (``Strategy.client_model``, traced once per
strategy, parameters, model and level) and with what it really transfers.

Pure: fleet + profiles (+ measured reports, + out-of-memory history) in, one plan row per device
out. No clocks, files or MQTT, so the round engine can re-plan whenever a device reports a
measured profile or an out-of-memory, and a test can check the rules on made-up devices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from functools import lru_cache

from coordinator.config.fleet import DATASET_SIZES, REPORTED, Device, Fleet
from coordinator.config.secure import EXCHANGES, round_size
from coordinator.strategies import STRATEGIES, ModelSpec
from coordinator.strategies.fedlora import FedLoRA
from device_agent.common.profile import DeviceProfile
from device_agent.layers.lora import lora_layers
from device_agent.models import model_card
from profiles.catalog import profile_from_report
from profiles.costmodel import (
    ModelTrace,
    Workload,
    dataset_bytes,
    predict_process_peak,
    predict_step_seconds,
    trace_module,
)
from profiles.schema import DeviceClass

_GIB = 1024**3


@dataclass(frozen=True)
class DevicePlan:
    """One device's share of the work; ``ratio`` is None when it is excluded (``reason`` says why).

    ``model`` (what the level means to the strategy: "gamma 1/4", "width 0.5", "full model") and
    ``trainable_params`` describe the client model the estimates are for: the planned one, or for
    an excluded device the smallest it was tried at.
    """

    device: str
    profile: str
    ratio: float | None
    model: str | None
    trainable_params: int | None
    est_memory_bytes: int | None
    memory_budget_bytes: int | None
    est_round_seconds: float | None
    deadline_seconds: float
    reason: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class LevelCost:
    """What one level of a strategy puts on a device: its traced client model and the bytes it moves per round."""

    label: str
    trace: ModelTrace
    download_bytes: int
    upload_bytes: int


@dataclass(frozen=True)
class _Estimate:
    cost: LevelCost
    memory: int
    seconds: float


def model_spec(fleet: Fleet) -> ModelSpec:
    """The fleet's model with the model card's input shape where the fleet leaves it out."""
    model = fleet.model
    card = model_card(model.arch)
    return ModelSpec(
        model.arch, model.num_classes, model.in_channels or card.in_channels, model.image_size or card.image_size
    )


def level_cost(fleet: Fleet, level: float) -> LevelCost:
    """The cost of ``level`` under the fleet's strategy (cached by strategy, parameters, model and level).

    Under ``secure_aggregation`` every device masks a vector of the full model (a width slice padded, FedHM's
    factors rebuilt dense, HetLoRA's padded to the largest rank, fedlora's products B A dense:
    docs/secure-aggregation.md) and sends the protocol's messages too."""
    params = json.dumps(fleet.strategy.params, sort_keys=True)
    cost = _level_cost(fleet.strategy.name, params, model_spec(fleet), level)
    if fleet.secure_aggregation is None:
        return cost
    values = _secure_values(fleet.strategy.name, params, model_spec(fleet))
    devices = round_size(len(fleet.devices), fleet.participation)
    return replace(cost, upload_bytes=fleet.secure_aggregation.upload_bytes(values, devices))


@lru_cache(maxsize=128)
def _secure_values(strategy: str, params_json: str, model: ModelSpec) -> int:
    """The values a device masks under secure aggregation: the largest level's upload; fedlora's adapters as the
    dense products each device rebuilds (out x in per layer instead of r (out + in))."""
    values = _level_cost(strategy, params_json, model, 1.0).upload_bytes // 4  # float32 values
    cls = STRATEGIES[strategy]
    if issubclass(cls, FedLoRA):
        params = cls.Params.model_validate(json.loads(params_json))
        rank = cls.rank_of(params, 1.0)
        for layer in lora_layers(cls.client_model(model, params, 1.0)).values():
            values += layer.out_features * layer.in_features - rank * (layer.out_features + layer.in_features)
    return values


@lru_cache(maxsize=128)
def _level_cost(strategy: str, params_json: str, model: ModelSpec, level: float) -> LevelCost:
    cls = STRATEGIES[strategy]
    params = cls.Params.model_validate(json.loads(params_json))
    trace = trace_module(cls.client_model(model, params, level), model.in_channels, model.image_size)
    return LevelCost(
        cls.level_label(params, level),
        trace,
        cls.download_bytes(model, params, level),
        cls.upload_bytes(model, params, level),
    )


def fmt_ratio(ratio: float) -> str:
    return str(Fraction(ratio).limit_denominator(1000))


def fmt_bytes(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB / 4 else f"{n / 2**20:.0f} MiB"


def effective_profile(device: Device, base: DeviceClass | None, report: DeviceProfile | None) -> DeviceClass | None:
    """The profile the plan uses: a measured report over the static class, then the fleet's overrides."""
    profile = profile_from_report(report, base) if report is not None else base
    if profile is None:
        return None
    patches = {
        section: getattr(device.overrides, section).model_dump(exclude_none=True)
        for section in ("memory", "compute", "network")
        if getattr(device.overrides, section) is not None
    }
    if not patches:
        return profile
    data = profile.model_dump()
    for section, patch in patches.items():
        data[section].update(patch)
    return DeviceClass.model_validate(data)


def after_out_of_memory(
    ceilings: Mapping[str, float], device: str, failed_ratio: float, ratios: list[float]
) -> dict[str, float]:
    """New per-device ceilings after ``device`` ran out of memory at ``failed_ratio``: one level down.

    A device that fails at the smallest ratio gets a ceiling of 0, which excludes it.
    """
    lower = [r for r in sorted(ratios, reverse=True) if r < failed_ratio]
    updated = dict(ceilings)
    updated[device] = min(updated.get(device, 1.0), lower[0] if lower else 0.0)
    return updated


def plan_fleet(
    fleet: Fleet,
    catalog: Mapping[str, DeviceClass],
    reports: Mapping[str, DeviceProfile] | None = None,
    ceilings: Mapping[str, float] | None = None,
) -> list[DevicePlan]:
    """One plan row per device, in fleet order.

    ``reports``: measured profiles by device id (they override the static profile, and are the
    only profile of a ``profile: reported`` device). ``ceilings``: highest ratio per device id,
    from :func:`after_out_of_memory`.
    """
    reports = reports or {}
    ceilings = ceilings or {}
    return [
        plan_device(
            fleet,
            device,
            None if device.profile == REPORTED else catalog[device.profile],
            reports.get(device.id),
            ceilings.get(device.id),
        )
        for device in fleet.devices
    ]


def plan_device(
    fleet: Fleet,
    device: Device,
    base: DeviceClass | None,
    report: DeviceProfile | None = None,
    ceiling: float | None = None,
) -> DevicePlan:
    """One device's row: ratios are tried from the largest down, the first that fits wins.

    ``base`` is None for a ``profile: reported`` device; ``ceiling`` comes from out-of-memory reports.
    """
    deadline = fleet.round_deadline_s
    profile = effective_profile(device, base, report)
    label = device.profile if report is None else f"{device.profile} (measured)"
    if profile is None:
        return _unplanned(device.id, label, None, deadline, "waiting for the device's measured profile")
    budget = int(profile.memory.usable_bytes / fleet.planning.memory_safety_factor)
    caps = [c for c in (ceiling, device.overrides.max_ratio) if c is not None]
    cap = min(caps) if caps else 1.0
    candidates = [r for r in fleet.ratios if r <= cap]
    if not candidates:
        smallest = fmt_ratio(min(fleet.ratios))
        return _unplanned(device.id, label, budget, deadline, f"ran out of memory at the smallest ratio {smallest}")
    rejected: list[str] = []
    estimate = None
    for ratio in candidates:
        estimate = _estimate(fleet, device, profile, ratio)
        why_not = _why_not(estimate, budget, deadline, profile, fleet)
        if why_not is None:
            return DevicePlan(
                device.id,
                label,
                ratio,
                estimate.cost.label,
                estimate.cost.trace.trainable_params,
                estimate.memory,
                budget,
                round(estimate.seconds, 3),
                deadline,
                _why_this(ratio, fleet.ratios, cap, ceiling, rejected),
            )
        rejected.append(f"{estimate.cost.label}: {why_not}")
    assert estimate is not None
    return DevicePlan(
        device.id,
        label,
        None,
        estimate.cost.label,
        estimate.cost.trace.trainable_params,
        estimate.memory,
        budget,
        round(estimate.seconds, 3),
        deadline,
        f"excluded: even {rejected[-1]}" if len(rejected) > 1 else f"excluded: {rejected[-1]}",
    )


def why_no_one(plans: Mapping[str, DevicePlan], online: set[str]) -> str:
    """Why a round has no participant, in one line: nobody online, or each online device's reason."""
    if not online:
        return "no device is online"
    return "; ".join(f"{d}: {plans[d].reason}" for d in sorted(online) if d in plans and plans[d].ratio is None)


def _unplanned(device: str, profile: str, budget: int | None, deadline: float, reason: str) -> DevicePlan:
    """A row without estimates: the device has no profile yet, or no level is left to try."""
    return DevicePlan(device, profile, None, None, None, None, budget, None, deadline, reason)


def _estimate(fleet: Fleet, device: Device, profile: DeviceClass, ratio: float) -> _Estimate:
    batch = device.overrides.batch_size or fleet.training.batch_size
    epochs = device.overrides.local_epochs or fleet.training.local_epochs
    cost = level_cost(fleet, ratio)
    work = Workload(cost.trace, batch, fleet.training.optimizer)
    memory = predict_level_memory(fleet, device, profile, ratio)
    steps = epochs * math.ceil(fleet.samples_for(device) / batch)
    link = profile.network
    transfer = (
        cost.download_bytes * 8 / (link.downlink_mbps * 1e6)
        + cost.upload_bytes * 8 / (link.uplink_mbps * 1e6)
        + 2 * link.latency_ms / 1e3 * (1 + (EXCHANGES if fleet.secure_aggregation is not None else 0))
    )
    return _Estimate(cost, memory, steps * predict_step_seconds(work, profile) + transfer)


def predict_level_memory(fleet: Fleet, device: Device, profile: DeviceClass, level: float) -> int:
    """Peak memory of ``device``'s agent process over a round at ``level``: what the memory check compares."""
    batch = device.overrides.batch_size or fleet.training.batch_size
    cost = level_cost(fleet, level)
    return predict_process_peak(
        Workload(cost.trace, batch, fleet.training.optimizer),
        profile.accelerator,
        download_bytes=cost.download_bytes,
        upload_bytes=cost.upload_bytes,
        data_bytes=data_bytes(fleet, device),
        samples=fleet.samples_for(device),
    ).total


def data_bytes(fleet: Fleet, device: Device) -> int:
    """What a device's agent holds of its data: the data set it loads (whole) and its own share."""
    spec = model_spec(fleet)
    share = fleet.samples_for(device)
    whole = DATASET_SIZES.get(fleet.dataset.name, share * len(fleet.devices))
    return dataset_bytes(whole + share, spec.in_channels, spec.image_size)


def _why_not(estimate: _Estimate, budget: int, deadline: float, profile: DeviceClass, fleet: Fleet) -> str | None:
    if estimate.memory > budget:
        usable = profile.memory.usable_bytes
        return (
            f"needs {fmt_bytes(estimate.memory)} > budget {fmt_bytes(budget)} "
            f"({fmt_bytes(usable)} usable / safety {fleet.planning.memory_safety_factor:g})"
        )
    if estimate.seconds > deadline:
        seconds = f"{estimate.seconds:.0f}" if estimate.seconds >= 10 else f"{estimate.seconds:.2g}"  # not "~0 s"
        return f"round takes ~{seconds} s > deadline {deadline:g} s"
    return None


def _why_this(ratio: float, ratios: list[float], cap: float, ceiling: float | None, rejected: list[str]) -> str:
    if rejected:
        return f"largest that fits; {rejected[-1]}"
    if ceiling is not None and ceiling < max(ratios) and ratio == ceiling:
        return f"capped at {fmt_ratio(ceiling)} after running out of memory above it"
    if cap < max(ratios):
        return f"capped at {fmt_ratio(cap)} by overrides.max_ratio"
    return "largest allowed ratio fits"
