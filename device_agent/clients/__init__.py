"""Client programs by strategy name: the agent looks up ``CLIENTS[meta["strategy"]]``.

Several strategies share one program (fedavg, fedavg_small, heterofl and fedrolex all train a
dense model of some width).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from device_agent.clients.base import ClientProgram
from device_agent.clients.fedfac import FedFacProgram
from device_agent.clients.fedhm import FedHMProgram
from device_agent.clients.rank_one import FactorizedFLBetaProgram, FactorizedFLProgram, SimFedProgram
from device_agent.clients.width import WidthProgram

CLIENTS: dict[str, type[ClientProgram]] = {
    "fedhm": FedHMProgram,
    "fedavg": WidthProgram,
    "fedavg_small": WidthProgram,
    "heterofl": WidthProgram,
    "fedrolex": WidthProgram,
    "factorized_fl": FactorizedFLProgram,
    "factorized_fl_beta": FactorizedFLBetaProgram,
    "simfed": SimFedProgram,
    "fedfac": FedFacProgram,
}


def build_program(
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor] | None = None,
) -> ClientProgram:
    """The program for an assignment; an unknown strategy is named in the error."""
    name = meta.get("strategy")
    try:
        program = CLIENTS[name]  # type: ignore[index]
    except KeyError:
        raise ValueError(
            f"unknown strategy {name!r} in assignment; this agent knows: {', '.join(sorted(CLIENTS))}"
        ) from None
    return program(meta, tensors, local)


__all__ = ["CLIENTS", "ClientProgram", "build_program"]
