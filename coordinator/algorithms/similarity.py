"""Similarity-weighted personalization shared by Factorized-FL (seed 000) and SimFed (seed 001).

Every client k gets its own mixture of the round's uploads: cosine similarities sigma_ki between
client descriptors (v of the second-to-last layer, or the embedding of a criteria input), peers
below tau dropped, sigma_kk = 1, weights softmax(scale * sigma) over what is left. All mixtures are
computed from one matrix of the SAME round's inputs, in client-id order, so the result does not
depend on the order uploads arrived in (the reference overwrote u in place inside its loop).

"Set to zero" in seed 000's Eq. 4 is read as the reference code reads it: a dropped peer gets
weight 0, not exp(0). ``min_peers`` keeps at least that many of the most similar peers even below
tau: the reference's ``minimum_aggr`` minus one, since the reference counts the client itself
among the ``minimum_aggr`` it keeps (its multi-domain 4 is ``min_peers: 3``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def cosine_matrix(descriptors: Tensor) -> Tensor:
    """(K, d) -> (K, K) cosine similarities, with exactly 1 on the diagonal."""
    if descriptors.dim() != 2:
        raise ValueError(f"expected a (clients, features) matrix, got shape {tuple(descriptors.shape)}")
    x = descriptors.to(torch.float64)
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    sim = (unit @ unit.T).clamp(-1.0, 1.0)
    sim.diagonal().fill_(1.0)
    return sim


def mixing_weights(similarity: Tensor, tau: float, scale: float, min_peers: int = 0) -> Tensor:
    """Row-stochastic (K, K) weights: row k is client k's softmax over itself and its kept peers."""
    k = similarity.shape[0]
    if similarity.shape != (k, k):
        raise ValueError(f"similarity must be square, got shape {tuple(similarity.shape)}")
    if min_peers < 0:
        raise ValueError(f"min_peers must be >= 0, got {min_peers}")
    sim = similarity.to(torch.float64).clone()
    sim.diagonal().fill_(1.0)
    keep = sim >= tau
    keep.fill_diagonal_(True)
    if min_peers:
        peers = sim.clone()
        peers.fill_diagonal_(-torch.inf)
        # Stable sort: equal scores keep client-id order, so ties never depend on arrival order.
        order = torch.sort(peers, dim=1, descending=True, stable=True).indices[:, : min(min_peers, k - 1)]
        keep.scatter_(1, order, True)
    logits = torch.where(keep, scale * sim, torch.full_like(sim, -torch.inf))
    return torch.softmax(logits, dim=1)


def mix(weights: Tensor, stacked: Tensor) -> Tensor:
    """Seed 000 Eq. 5: row k of the result is sum_i weights[k, i] * stacked[i] (any trailing shape)."""
    flat = stacked.reshape(stacked.shape[0], -1).to(torch.float64)
    return (weights @ flat).reshape(stacked.shape).to(stacked.dtype)


def reflect(weights: Tensor, stacked: Tensor) -> Tensor:
    """Seed 001 Eq. 8: theta_k + sum_j weights[k, j] * (theta_j - theta_k).

    With self in the softmax (sigma_kk = 1, as in seed 000's Eq. 5; SimFed has no public code)
    this equals :func:`mix` up to rounding; it is kept in the paper's difference form so that
    weights not summing to one still leave theta_k where its peers do not pull it.
    """
    flat = stacked.reshape(stacked.shape[0], -1).to(torch.float64)
    delta = weights @ flat - weights.sum(dim=1, keepdim=True) * flat
    return (flat + delta).reshape(stacked.shape).to(stacked.dtype)
