"""Client programs: one module per strategy family, each program registered under its strategies' names.

Several strategies share one program (fedavg, fedavg_small, heterofl and fedrolex all train a dense
model of some width): their names share ``WidthSpec``. Another package adds a program through the
``fedfleet.clients`` entry point group (see the docs' "Adding a strategy").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from device_agent.clients.base import ClientProgram
from device_agent.clients.registry import PROGRAMS
from device_agent.clients.spec import CLIENT_SPEC, ClientSpec, SpecBase, TrainConfig


def build_program(
    spec: SpecBase,
    tensors: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor] | None = None,
) -> ClientProgram:
    """The program registered for the assignment's strategy."""
    program = PROGRAMS.get(spec.strategy)
    if program is None or not isinstance(spec, program.Spec):
        raise ValueError(f"no client program consumes {type(spec).__name__} (strategy {spec.strategy!r})")
    return program(spec, tensors, local)


__all__ = ["CLIENT_SPEC", "PROGRAMS", "ClientProgram", "ClientSpec", "TrainConfig", "build_program"]
