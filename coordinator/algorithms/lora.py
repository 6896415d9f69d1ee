"""FedLoRA's server-side re-factorization: an averaged adapter update back into rank-r factors.

Pure tensor code. FedHM re-factorizes with a balanced split (A = U sqrt(S), B = sqrt(S) V^T);
for adapters that split is wrong where the averaged update has (near) zero singular values, as it
has in every direction no client used yet: both factors come out zero there, their gradients are
zero too, and those rank components never train. Here A keeps orthonormal rows (V_r^T) and B
carries the magnitude (U_r S_r / scale), so scale * B A is still exactly the best rank-r
approximation of the update (Eckart-Young) while every row of A stays live, like LoRA's own init.
"""

from __future__ import annotations

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
