"""FedFac's factor analysis (seed 002, Sec. 4.1): which hidden elements of a layer clients share.

For one layer, each client's weights of each hidden element (a conv filter or a neuron's row, length
d) are stacked over clients into X of shape (K*d, d_l): observations are weights across clients,
variables the d_l hidden elements. Elements whose variation is largely explained by a few common
factors (high communality) are shared and averaged; the others stay personal.

Two corrections to the reference implementation (ffair/FedFac): the number of factors is the
smallest m whose cumulative eigenvalue share reaches kappa (the reference is off by one), and the
loadings are the paper's iterated principal-factor estimate (Eq. 7); the reference's raw
eigenvectors remain available as ``method="eigenvectors"``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LoadingMethod = Literal["principal_factor", "eigenvectors"]


def element_matrix(weights: Sequence[Tensor]) -> Tensor:
    """Stack each client's layer weight (d_l, ...) into X (K*d, d_l): column j is element j across clients."""
    if not weights:
        raise ValueError("factor analysis needs at least one client's weights")
    shape = weights[0].shape
    for index, w in enumerate(weights):
        if w.shape != shape:
            raise ValueError(f"client {index}: weight shape {tuple(w.shape)} differs from {tuple(shape)}")
    return torch.cat([w.detach().to(torch.float64).reshape(shape[0], -1).T for w in weights], dim=0)


def standardize(x: Tensor) -> Tensor:
    """Columns centred and scaled to unit norm, so X^T X is the correlation matrix.

    A constant column (zero variance) stays zero: it correlates with nothing.
    """
    centred = x - x.mean(dim=0, keepdim=True)
    norms = centred.norm(dim=0, keepdim=True)
    return torch.where(norms > 0, centred / norms.clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(centred))


def correlation(x: Tensor) -> Tensor:
    """Correlation matrix R (d_l x d_l) of X's columns, with a unit diagonal even for constant columns."""
    z = standardize(x)
    r = z.T @ z
    r.diagonal().fill_(1.0)
    return r


def eigen_descending(r: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric eigendecomposition with eigenvalues (clamped at 0) in decreasing order."""
    values, vectors = torch.linalg.eigh(r)
    return values.flip(0).clamp_min(0.0), vectors.flip(1)


def number_of_factors(eigenvalues: Tensor, kappa: float) -> int:
    """G = min{m : sum_{j<=m} lambda_j / sum_j lambda_j >= kappa}, eigenvalues in decreasing order.

    Counted from 1: if the first eigenvalue alone reaches kappa, G = 1.
    """
    if not 0.0 < kappa <= 1.0:
        raise ValueError(f"kappa must be in (0, 1], got {kappa}")
    total = float(eigenvalues.sum())
    if total <= 0:
        raise ValueError("the correlation matrix has no positive eigenvalue")
    shares = torch.cumsum(eigenvalues, 0) / total
    # A relative slack so that a share equal to kappa in exact arithmetic is not lost to rounding.
    reached = torch.nonzero(shares >= kappa - 1e-12).flatten()
    return int(reached[0]) + 1 if len(reached) else len(eigenvalues)


def eigenvector_loadings(r: Tensor, num_factors: int) -> Tensor:
    """The reference's loadings: the top ``num_factors`` eigenvectors of R, unscaled."""
    _, vectors = eigen_descending(r)
    return vectors[:, :num_factors]


def principal_factor_loadings(r: Tensor, num_factors: int, max_iter: int = 200, tol: float = 1e-6) -> Tensor:
    """Iterated principal-factor estimate of A (d_l x G) with R = A A^T + Psi (seed 002, Eq. 7).

    Start from A = [sqrt(lambda_j) u_j] of R, set Psi = diag(R - A A^T), refactor R - Psi, and
    repeat until Psi moves by less than ``tol``. Psi is kept >= 0 (a Heywood case, communality
    above 1, is clipped rather than allowed to make R - Psi's diagonal exceed 1).
    """
    if not 1 <= num_factors <= r.shape[0]:
        raise ValueError(f"num_factors must be in [1, {r.shape[0]}], got {num_factors}")

    def top_loadings(matrix: Tensor) -> Tensor:
        values, vectors = eigen_descending(matrix)
        return vectors[:, :num_factors] * values[:num_factors].sqrt()

    loadings = top_loadings(r)
    psi = (r.diagonal() - (loadings**2).sum(1)).clamp_min(0.0)
    for _ in range(max_iter):
        loadings = top_loadings(r - torch.diag(psi))
        new_psi = (r.diagonal() - (loadings**2).sum(1)).clamp_min(0.0)
        settled = float((new_psi - psi).abs().max()) < tol
        psi = new_psi
        if settled:
            break
    return loadings


def communalities(loadings: Tensor) -> Tensor:
    """nu_j = sum_g A_jg^2: the share of element j's variance the common factors explain."""
    return (loadings**2).sum(1)


def threshold(nu: Tensor, quantile: float | None) -> float:
    """tau_l: a quantile of the communalities, or +inf (``None``: every element personal)."""
    if quantile is None:
        return math.inf
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"tau quantile must be in [0, 1], got {quantile}")
    return float(torch.quantile(nu, quantile))


@dataclass(frozen=True)
class FactorSplit:
    """One layer's split: ``shared[j]`` is True for elements averaged across clients."""

    shared: Tensor
    num_factors: int
    communalities: Tensor
    threshold: float


def split_elements(
    weights: Sequence[Tensor],
    kappa: float = 0.85,
    quantile: float | None = 0.5,
    method: LoadingMethod = "principal_factor",
) -> FactorSplit:
    """Factor analysis on one layer's weights from every client -> which elements are shared."""
    r = correlation(element_matrix(weights))
    values, _ = eigen_descending(r)
    g = number_of_factors(values, kappa)
    if method == "principal_factor":
        loadings = principal_factor_loadings(r, g)
    elif method == "eigenvectors":
        loadings = eigenvector_loadings(r, g)
    else:
        raise ValueError(f"unknown loading method {method!r}; choose principal_factor or eigenvectors")
    nu = communalities(loadings)
    tau = threshold(nu, quantile)
    return FactorSplit(shared=nu >= tau, num_factors=g, communalities=nu, threshold=tau)
