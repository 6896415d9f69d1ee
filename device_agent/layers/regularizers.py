"""Frobenius decay for FedHM factors (Khodak et al.), and optimizer groups that use it.

Plain L2 on the factors A and B penalizes a parametrization, not the layer: ||A||^2 + ||B||^2
changes when A is scaled up and B down. Frobenius decay penalizes the product,
lambda/2 * ||A B||_F^2, whose gradient is dA = lambda * A (B B^T), dB = lambda * (A^T A) B. The
reference code applies both L2 and FD to factors (a double decay); here factors get FD only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from device_agent.layers.factorized import LowRankLayer, factors_to_matrices, matrices_to_factors


def factorized_layers(model: nn.Module) -> list[LowRankLayer]:
    return [m for m in model.modules() if isinstance(m, LowRankLayer)]


def frobenius_penalty(model: nn.Module, strength: float) -> Tensor:
    """lambda/2 * sum over factorized layers of ||A B||_F^2, differentiable (for checks and logging).

    Computed as trace((A^T A)(B B^T)) so no dense weight is formed.
    """
    total = torch.zeros(())
    for layer in factorized_layers(model):
        a, b = factors_to_matrices(layer.reduce, layer.expand)
        total = total + ((a.T @ a) * (b @ b.T)).sum()
    return 0.5 * strength * total


@torch.no_grad()
def apply_frobenius_decay_(model: nn.Module, strength: float) -> None:
    """Add the Frobenius decay gradient to the factors' .grad; call between backward() and step()."""
    if strength == 0:
        return
    for layer in factorized_layers(model):
        a, b = factors_to_matrices(layer.reduce, layer.expand)
        grad_a = strength * (a @ (b @ b.T))
        grad_b = strength * ((a.T @ a) @ b)
        grad_reduce, grad_expand = matrices_to_factors(grad_a, grad_b, layer.weight_shape)
        for param, grad in ((layer.reduce, grad_reduce), (layer.expand, grad_expand)):
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.add_(grad)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer groups: L2 ``weight_decay`` for dense parameters, none for factors (they get FD)."""
    factor_ids = {id(p) for layer in factorized_layers(model) for p in (layer.reduce, layer.expand)}
    factors = [p for p in model.parameters() if id(p) in factor_ids]
    dense = [p for p in model.parameters() if id(p) not in factor_ids]
    groups = [{"params": dense, "weight_decay": weight_decay}]
    if factors:
        groups.append({"params": factors, "weight_decay": 0.0})
    return groups
