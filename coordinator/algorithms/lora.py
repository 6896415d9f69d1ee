"""FedLoRA's server-side re-factorization: an averaged adapter update back into rank-r factors.

Pure tensor code. FedHM re-factorizes with a balanced split (A = U sqrt(S), B = sqrt(S) V^T);
for adapters that split is wrong where the averaged update has (near) zero singular values, as it
has in every direction no client used yet: both factors come out zero there, their gradients are
zero too, and those rank components never train. Here A keeps orthonormal rows (V_r^T) and B
carries the magnitude (U_r S_r / scale), so scale * B A is still exactly the best rank-r
approximation of the update (Eckart-Young) while every row of A stays live, like LoRA's own init.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def lora_factors(delta: Tensor, ranks: dict[int, float]) -> dict[int, tuple[Tensor, Tensor]]:
    """``rank -> (reduce A (r, in), expand B (out, r))`` with scale * B A the truncated SVD of ``delta``.

    ``ranks`` maps each rank to its LoRA scale (alpha / r). One SVD serves every rank by truncation.
    """
    top = max(ranks)
    if top > min(delta.shape):
        raise ValueError(f"rank {top} exceeds the {tuple(delta.shape)} update's dimensions")
    u, s, vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    return {
        r: (vh[:r].to(delta.dtype).contiguous(), (u[:, :r] * (s[:r] / scale)).to(delta.dtype).contiguous())
        for r, scale in ranks.items()
    }


# The aggregation rules a user compares (docs/strategies.md, "LoRA aggregation rules"). Each takes one
# layer's uploads in effective form, B already multiplied by the client's scale alpha / r_i, so that
# ``expand @ reduce`` is the update that client applies, and returns effective factors too: the strategy
# divides B by the receiving client's own scale.


@dataclass(frozen=True)
class ClientFactors:
    """One client's adapter on one layer: B (out, r) and A (r, in) with B A its update, and its weight."""

    expand: Tensor
    reduce: Tensor
    weight: float

    @property
    def rank(self) -> int:
        return self.reduce.shape[0]


def _normalized(weights: Sequence[float]) -> list[float]:
    total = math.fsum(weights)
    if not total > 0:
        raise ValueError(f"aggregation weights must sum to a positive number, got {list(weights)}")
    return [w / total for w in weights]


def average_products(clients: Sequence[ClientFactors]) -> Tensor:
    """sum_i w_i B_i A_i / sum_i w_i in float64: the update every exact rule aims at."""
    weights = _normalized([c.weight for c in clients])
    return sum(
        (w * (c.expand.double() @ c.reduce.double()) for w, c in zip(weights, clients, strict=True)),
        start=torch.zeros(()),
    )


def svd_rule(clients: Sequence[ClientFactors], ranks: Iterable[int]) -> dict[int, tuple[Tensor, Tensor]]:
    """The FedHM paper's rule (Sec. 5, as FedHM Eq. 2-3) and FlexLoRA's: average the products, SVD per rank.

    ``rank -> (A, B)`` with B A the best rank-r approximation of the averaged update. ``fedlora``
    computes the same while uploads stream in (its weights are FedHM's, not necessarily samples).
    """
    return lora_factors(average_products(clients), dict.fromkeys(ranks, 1.0))


def sparsity_weights(clients: Sequence[ClientFactors]) -> list[float]:
    """HetLoRA's aggregation weights (Cho et al. 2024, Fig. 2): ||B_i A_i||_F / sum_k ||B_k A_k||_F."""
    return _normalized([float(torch.linalg.matrix_norm(c.expand.double() @ c.reduce.double())) for c in clients])


def zero_pad_average(clients: Sequence[ClientFactors], rank: int, weights: Sequence[float]) -> tuple[Tensor, Tensor]:
    """HetLoRA's global factors ``(A (rank, in), B (out, rank))``: each client's A padded with zero rows and
    B with zero columns up to ``rank``, then both averaged with ``weights``; a client at r receives the
    first r rows of A and columns of B. Not exact: the product of the averages is not the average of the
    products, and a rank component trained by few clients is diluted by the others' zeros."""
    if any(c.rank > rank for c in clients):
        raise ValueError(f"a client rank exceeds the global rank {rank}")
    out_features, in_features = clients[0].expand.shape[0], clients[0].reduce.shape[1]
    reduce = torch.zeros(rank, in_features, dtype=torch.float64)
    expand = torch.zeros(out_features, rank, dtype=torch.float64)
    for w, c in zip(_normalized(weights), clients, strict=True):
        reduce[: c.rank] += w * c.reduce.double()
        expand[:, : c.rank] += w * c.expand.double()
    return reduce, expand


def stack(clients: Sequence[ClientFactors]) -> tuple[Tensor, Tensor]:
    """FLoRA's stacking (Wang et al., NeurIPS 2024): ``(A (sum r_i, in), B (out, sum r_i))``.

    A_i's rows are scaled by the normalized weight w_i and stacked, B_i's columns stacked as they are
    (as FederatedLLM's ``FedAvg(stacking=True)``), so B A = sum_i w_i B_i A_i exactly. The rank is
    the sum of the clients' ranks, which is why FLoRA merges it into the base weights every round.
    """
    weights = _normalized([c.weight for c in clients])
    reduce = torch.cat([w * c.reduce.double() for w, c in zip(weights, clients, strict=True)], dim=0)
    expand = torch.cat([c.expand.double() for c in clients], dim=1)
    return reduce, expand


def average_factors(clients: Sequence[ClientFactors]) -> tuple[Tensor, Tensor]:
    """FedIT's rule (Zhang et al. 2024), FedAvg on LoRA: ``(mean A, mean B)``, weighted; every rank equal.

    ``lora_homogeneous`` computes the same while uploads stream in. Not exact: mean B mean A differs
    from the mean of B_i A_i by the cross terms.
    """
    if len({c.rank for c in clients}) != 1:
        raise ValueError(f"factor averaging needs one rank, got {sorted({c.rank for c in clients})}")
    weights = _normalized([c.weight for c in clients])
    reduce = sum((w * c.reduce.double() for w, c in zip(weights, clients, strict=True)), start=torch.zeros(()))
    expand = sum((w * c.expand.double() for w, c in zip(weights, clients, strict=True)), start=torch.zeros(()))
    return reduce, expand
