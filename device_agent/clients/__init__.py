"""Client programs, looked up by the type of the spec an assignment carries.

Each program names the one spec class it consumes; the spec union in ``device_agent.clients.spec``
is keyed on the strategy name, so an assignment parses straight into that class. Several
strategies share one program (fedavg, fedavg_small, heterofl and fedrolex all train a dense model
of some width): their names share ``WidthSpec``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from device_agent.clients.base import ClientProgram
from device_agent.clients.fedfac import FedFacProgram
from device_agent.clients.fedhm import FedHMProgram
from device_agent.clients.lora import LoRAProgram
from device_agent.clients.rank_one import FactorizedFLBetaProgram, FactorizedFLProgram, SimFedProgram
from device_agent.clients.spec import CLIENT_SPEC, SPEC_TYPES, ClientSpec, SpecBase, TrainConfig, strategies_of
from device_agent.clients.width import WidthProgram

PROGRAMS: dict[type[SpecBase], type[ClientProgram]] = {
    program.Spec: program
    for program in (
        FedHMProgram,
        WidthProgram,
        FactorizedFLProgram,
        FactorizedFLBetaProgram,
        SimFedProgram,
        FedFacProgram,
        LoRAProgram,
    )
}

KNOWN_STRATEGIES: tuple[str, ...] = tuple(name for spec in SPEC_TYPES for name in strategies_of(spec))


def build_program(
    spec: SpecBase,
    tensors: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor] | None = None,
) -> ClientProgram:
    """The program for an assignment's spec."""
    try:
        program = PROGRAMS[type(spec)]
    except KeyError:
        raise ValueError(f"no client program consumes {type(spec).__name__}") from None
    return program(spec, tensors, local)


__all__ = [
    "CLIENT_SPEC",
    "KNOWN_STRATEGIES",
    "PROGRAMS",
    "ClientProgram",
    "ClientSpec",
    "TrainConfig",
    "build_program",
]
