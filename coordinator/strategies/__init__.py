"""Strategies by name, as ``fleet.yaml`` selects them, with their parameters validated.

Every strategy registers itself when its module is imported (:class:`~coordinator.strategies.base.Strategy`
subclasses that set ``name``); the registry imports this package's modules and the ``fedfleet.strategies``
entry points of installed packages on first use. A strategy is one module here plus its client
program's module in ``device_agent/clients/``; nothing else is edited.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from coordinator.strategies.base import STRATEGIES, Assignment, ClientSlot, ModelSpec, RoundAggregate, Strategy
from coordinator.strategies.upload_contract import UploadContract
from device_agent.common.validation import describe


def build_strategy(name: str, model: ModelSpec, params: Mapping[str, Any] | None = None, seed: int = 0) -> Strategy:
    """A strategy with validated parameters; errors name the strategy and the parameter."""
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")
    try:
        validated = cls.Params.model_validate(dict(params or {}))
    except ValidationError as error:
        raise ValueError(f"strategy {name!r} parameters: {describe(error, empty='(params)')}") from None
    return cls(model, validated, seed)


__all__ = [
    "STRATEGIES",
    "Assignment",
    "ClientSlot",
    "ModelSpec",
    "RoundAggregate",
    "Strategy",
    "UploadContract",
    "build_strategy",
]
