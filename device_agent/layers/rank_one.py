"""Rank-one-plus-sparse layers of Factorized-FL (seed 000) and SimFed (seed 001).

Every weight is ``pi(u v^T + mu)``: two vectors whose outer product carries most of the layer and a
dense-shaped ``mu`` that starts at zero and is pushed towards sparsity by an L1 term on the device.
Only the matrix view ``pi`` differs between the two papers:

- ``kernel`` (Factorized-FL, Eq. 3): for a F x F conv, u in R^{F*F} indexes kernel positions and
  v in R^{O*I} indexes (output, input) channel pairs, so ``W[o, i] = (u * v[o*I + i]).reshape(F, F)
  + mu[:, o*I + i].reshape(F, F)``: u is a base filter shared by every channel pair. The reference
  code does a plain ``.view(O, I, F, F)`` of the (F*F, O*I) matrix, which makes u scale contiguous
  slices of the flattened weight instead of kernel positions; this module does not.
- ``channel`` (SimFed, Eq. 6): u in R^{I*F} indexes (input channel, kernel column) and v in
  R^{O*F} (output channel, kernel row): ``W[o, i, r, c] = u[i*F + c] * v[o*F + r] + mu[i*F + c, o*F + r]``.
  This matrix is the transpose of FedHM's matrix view (``weight_to_matrix``).

A linear layer (I -> O) is the same in both: u in R^I, v in R^O, ``W = (u v^T + mu)^T``.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from device_agent.layers.factorized import matrix_to_weight, weight_to_matrix

Layout = Literal["kernel", "channel"]
LAYOUTS: tuple[Layout, ...] = ("kernel", "channel")


def to_matrix(weight: Tensor, layout: Layout) -> Tensor:
    """Dense weight -> the matrix whose rank-one part is ``u v^T`` under ``layout``."""
    if weight.dim() == 2:
        return weight.T
    if layout == "kernel":
        c_out, c_in, kh, kw = weight.shape
        return weight.reshape(c_out * c_in, kh * kw).T
    if layout == "channel":
        return weight_to_matrix(weight).T
    raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")


def from_matrix(matrix: Tensor, shape: tuple[int, ...], layout: Layout) -> Tensor:
    """Inverse of :func:`to_matrix`: the weight reshaping function pi."""
    if len(shape) == 2:
        return matrix.T
    if layout == "kernel":
        return matrix.T.reshape(shape)
    if layout == "channel":
        return matrix_to_weight(matrix.T, shape)
    raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")


class RankOneLayer(nn.Module):
    """A conv or linear layer trained as ``u``, ``v`` and ``mu`` (plus the dense layer's bias).

    ``prune_below`` zeroes entries of mu with smaller magnitude in evaluation mode only (the
    paper's sparse deployment); training always sees the live mu so its L1 term has a gradient.
    """

    def __init__(
        self,
        weight_shape: tuple[int, ...],
        layout: Layout = "kernel",
        stride: int = 1,
        padding: int = 0,
        bias: bool = False,
        prune_below: float = 0.0,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
        if len(weight_shape) not in (2, 4):
            raise ValueError(f"expected a linear (2-d) or conv (4-d) weight shape, got {weight_shape}")
        if len(weight_shape) == 4 and weight_shape[2] != weight_shape[3]:
            raise ValueError(f"rank-one conv layers need square kernels, got {weight_shape[2]}x{weight_shape[3]}")
        self.weight_shape = tuple(weight_shape)
        self.layout: Layout = layout
        self.stride, self.padding, self.prune_below = stride, padding, prune_below
        rows, cols = to_matrix(torch.empty(self.weight_shape, device="meta"), layout).shape
        self.u = nn.Parameter(torch.zeros(rows))
        self.v = nn.Parameter(torch.zeros(cols))
        self.mu = nn.Parameter(torch.zeros(rows, cols))
        out_channels = self.weight_shape[0]
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    @property
    def is_conv(self) -> bool:
        return len(self.weight_shape) == 4

    @torch.no_grad()
    def load_dense_(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Reparametrize a dense weight: u v^T = its best rank-one approximation, mu = 0.

        This is "reparameterize at initialization" (seed 000, Sec. 4.1): the model starts from the
        rank-one part of the ordinary initialization, and mu learns what rank one misses.
        """
        if tuple(weight.shape) != self.weight_shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match layer {self.weight_shape}")
        matrix = to_matrix(weight.detach().to(torch.float64), self.layout)
        left, sigma, right = torch.linalg.svd(matrix, full_matrices=False)
        root = sigma[0].sqrt()
        self.u.copy_(left[:, 0] * root)
        self.v.copy_(right[0] * root)
        self.mu.zero_()
        if bias is not None and self.bias is not None:
            self.bias.copy_(bias)

    def live_mu(self) -> Tensor:
        if self.training or self.prune_below <= 0:
            return self.mu
        return self.mu.masked_fill(self.mu.abs() < self.prune_below, 0.0)

    def weight(self) -> Tensor:
        """The dense weight pi(u v^T + mu), differentiable in u, v and mu."""
        return from_matrix(torch.outer(self.u, self.v) + self.live_mu(), self.weight_shape, self.layout)

    def forward(self, x: Tensor) -> Tensor:
        if self.is_conv:
            return F.conv2d(x, self.weight(), self.bias, stride=self.stride, padding=self.padding)
        return F.linear(x, self.weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{self.weight_shape}, layout={self.layout}, stride={self.stride}, padding={self.padding}"


def _check_convertible(name: str, module: nn.Module) -> None:
    if isinstance(module, nn.Conv2d):
        problems = []
        if module.groups != 1:
            problems.append(f"groups={module.groups}")
        if module.dilation != (1, 1):
            problems.append(f"dilation={module.dilation}")
        if module.stride[0] != module.stride[1] or module.padding[0] != module.padding[1]:  # type: ignore[index]
            problems.append(f"stride {module.stride} / padding {module.padding} differ between axes")
        if module.padding_mode != "zeros":
            problems.append(f"padding_mode={module.padding_mode!r}")
        if problems:
            raise ValueError(f"layer {name!r} cannot be made rank-one ({'; '.join(problems)}); list it in keep_dense")


def reparametrize(
    model: nn.Module,
    layout: Layout = "kernel",
    keep_dense: Sequence[str] = (),
    prune_below: float = 0.0,
) -> nn.Module:
    """Replace every Conv2d / Linear of ``model`` (in place) by a :class:`RankOneLayer` of its weights.

    Factorized-FL factorizes every layer, the first conv and the classifier included (as its
    reference does); ``keep_dense`` takes fnmatch patterns of module names to leave alone.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Conv2d | nn.Linear) and not any(fnmatchcase(name, p) for p in keep_dense)
    ]
    for name, module in targets:
        _check_convertible(name, module)
        if isinstance(module, nn.Conv2d):
            layer = RankOneLayer(
                tuple(module.weight.shape),
                layout,
                stride=module.stride[0],
                padding=int(module.padding[0]),  # type: ignore[index]
                bias=module.bias is not None,
                prune_below=prune_below,
            )
        else:
            layer = RankOneLayer(
                tuple(module.weight.shape), layout, bias=module.bias is not None, prune_below=prune_below
            )
        layer.load_dense_(module.weight, module.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
    return model


def rank_one_layers(model: nn.Module) -> dict[str, RankOneLayer]:
    """The model's rank-one layers by module name, in registration (= forward, for the zoo) order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, RankOneLayer)}


def similarity_layer(model: nn.Module) -> str:
    """Name of the second-to-last rank-one layer, whose v Factorized-FL compares between clients."""
    names = list(rank_one_layers(model))
    if len(names) < 2:
        raise ValueError(f"similarity needs at least two rank-one layers, the model has {len(names)}")
    return names[-2]


def l1_on_mu(model: nn.Module) -> Tensor:
    """sum of |mu| over every rank-one layer, on the live parameters (so it has a gradient)."""
    terms = [layer.mu.abs().sum() for layer in rank_one_layers(model).values()]
    if not terms:
        raise ValueError("the model has no rank-one layers")
    return torch.stack(terms).sum()


@torch.no_grad()
def dense_state(model: nn.Module) -> dict[str, Tensor]:
    """The plain model's state dict from a reparametrized one: each rank-one layer's pi(u v^T + mu)."""
    layers = rank_one_layers(model)
    state: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        name, _, leaf = key.rpartition(".")
        if name in layers:
            if leaf == "u":
                state[f"{name}.weight"] = layers[name].weight().detach().clone()
            elif leaf == "bias":
                state[key] = value.clone()
        else:
            state[key] = value.clone()
    return state
