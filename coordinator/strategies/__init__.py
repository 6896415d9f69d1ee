"""Strategies by name, as ``fleet.yaml`` selects them, with their parameters validated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from coordinator.strategies.base import Assignment, ClientSlot, ModelSpec, RoundAggregate, Strategy
from coordinator.strategies.factorized_fl import FactorizedFL, FactorizedFLBeta
from coordinator.strategies.fedfac import FedFac
from coordinator.strategies.fedhm import FedHM
from coordinator.strategies.fedlora import FedLoRA, FineTune, HomogeneousLoRA
from coordinator.strategies.simfed import SimFed
from coordinator.strategies.width import FedAvg, FedAvgSmall, FedRolex, HeteroFL
from device_agent.common.validation import describe

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (
        FedHM,
        FedAvg,
        FedAvgSmall,
        HeteroFL,
        FedRolex,
        FactorizedFL,
        FactorizedFLBeta,
        SimFed,
        FedFac,
        FedLoRA,
        HomogeneousLoRA,
        FineTune,
    )
}


def build_strategy(name: str, model: ModelSpec, params: Mapping[str, Any] | None = None, seed: int = 0) -> Strategy:
    """A strategy with validated parameters; errors name the strategy and the parameter."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(sorted(STRATEGIES))}") from None
    try:
        validated = cls.Params.model_validate(dict(params or {}))
    except ValidationError as error:
        raise ValueError(f"strategy {name!r} parameters: {describe(error, empty='(params)')}") from None
    return cls(model, validated, seed)


__all__ = ["STRATEGIES", "Assignment", "ClientSlot", "ModelSpec", "RoundAggregate", "Strategy", "build_strategy"]
