"""FedHM hybrid networks: a model with its later layers replaced by rank-r factorized ones.

``hybrid(name, gamma)`` is what a device trains; ``factorization_plan(name)`` is what the
server needs to move between full-rank weights and factors of any rank level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.nn.utils import skip_init

from device_agent.layers.factorized import FactorizedConv2d, FactorizedLinear, LowRankLayer, rank_for
from device_agent.models import build_model, model_card


@dataclass(frozen=True)
class LayerSpec:
    """Where a factorizable layer sits and what its full-rank weight looks like."""

    name: str
    shape: tuple[int, ...]
    stride: int = 1
    padding: int = 0
    bias: bool = False

    @property
    def is_conv(self) -> bool:
        return len(self.shape) == 4

    def rank(self, gamma: float) -> int:
        return rank_for(gamma, self.shape[0])

    def factor_shapes(self, gamma: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the (reduce, expand) tensors at rank ratio ``gamma``."""
        r = self.rank(gamma)
        if self.is_conv:
            c_out, c_in, k, _ = self.shape
            return (r, c_in, 1, k), (c_out, r, k, 1)
        out_features, in_features = self.shape
        return (r, in_features), (out_features, r)


def _spec_of(name: str, module: nn.Module) -> LayerSpec:
    if isinstance(module, nn.Linear):
        return LayerSpec(name, tuple(module.weight.shape), bias=module.bias is not None)
    conv = module
    assert isinstance(conv, nn.Conv2d)
    kh, kw = conv.kernel_size
    problems = []
    if kh != kw:
        problems.append(f"kernel {kh}x{kw} is not square")
    if conv.groups != 1:
        problems.append(f"groups={conv.groups}")
    if conv.dilation != (1, 1):
        problems.append(f"dilation={conv.dilation}")
    if conv.stride[0] != conv.stride[1] or conv.padding[0] != conv.padding[1]:  # type: ignore[index]
        problems.append(f"stride {conv.stride} / padding {conv.padding} differ between axes")
    if conv.padding_mode != "zeros":
        problems.append(f"padding_mode={conv.padding_mode!r}")
    if problems:
        raise ValueError(f"layer {name!r} cannot be factorized ({'; '.join(problems)}); add it to the full-rank set")
    return LayerSpec(
        name,
        tuple(conv.weight.shape),
        stride=conv.stride[0],
        padding=int(conv.padding[0]),  # type: ignore[index]
        bias=conv.bias is not None,
    )


def _plan(model: nn.Module, full_rank: Sequence[str]) -> dict[str, LayerSpec]:
    return {
        name: _spec_of(name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Conv2d | nn.Linear) and not any(fnmatchcase(name, p) for p in full_rank)
    }


def factorization_plan(
    name: str,
    num_classes: int = 10,
    in_channels: int | None = None,
    full_rank: Sequence[str] | None = None,
) -> dict[str, LayerSpec]:
    """Layers that are factorized whenever gamma < 1, keyed by module name (built on meta: free)."""
    with torch.device("meta"):
        model = build_model(name, num_classes, in_channels)
    return _plan(model, model_card(name).full_rank if full_rank is None else full_rank)


def hybrid(
    name: str,
    gamma: float,
    num_classes: int = 10,
    in_channels: int | None = None,
    full_rank: Sequence[str] | None = None,
) -> nn.Module:
    """The FedHM hybrid model at rank ratio ``gamma`` (1 = the plain model).

    Factorized layers start as the truncated SVD of the plain model's freshly initialized
    weights, so hybrid(name, g) under one seed is the rank-g projection of hybrid(name, 1).
    Pass ``full_rank`` (fnmatch patterns of module names) to override the model card's set.
    """
    rank_for(gamma, 1)
    model = build_model(name, num_classes, in_channels)
    if gamma == 1:
        return model
    patterns = model_card(name).full_rank if full_rank is None else full_rank
    for spec in _plan(model, patterns).values():
        parent_name, _, child = spec.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        dense = getattr(parent, child)
        setattr(parent, child, _factorize_module(dense, spec, gamma))
    return model


def _factorize_module(dense: nn.Module, spec: LayerSpec, gamma: float) -> nn.Module:
    rank = spec.rank(gamma)
    weight = dense.weight.detach()
    if spec.is_conv:
        c_out, c_in, k, _ = spec.shape
        layer: LowRankLayer = skip_init(
            FactorizedConv2d,
            c_in,
            c_out,
            k,
            rank,
            stride=spec.stride,
            padding=spec.padding,
            bias=spec.bias,
            device=weight.device,
        )
    else:
        out_features, in_features = spec.shape
        layer = skip_init(FactorizedLinear, in_features, out_features, rank, bias=spec.bias, device=weight.device)
    layer.load_dense_(weight)
    if spec.bias and weight.device.type != "meta":
        with torch.no_grad():
            layer.bias.copy_(dense.bias)
    return layer
