"""FedHM's two server-side moves between full-rank weights and low-rank factors.

``align`` (shape alignment) rebuilds full-rank weights from a client's factors;
``factorize`` (spectral initialization) turns the global full-rank weights into the factors of
every rank level in play, from one decomposition per layer. Pure functions on state dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import Tensor

from device_agent.layers.factorized import matrices_to_factors, reconstruct, spectral_factors, weight_to_matrix
from device_agent.layers.hybrid import LayerSpec

State = Mapping[str, Tensor]


def factor_keys(name: str) -> tuple[str, str]:
    return f"{name}.reduce", f"{name}.expand"


def align(state: State, plan: Mapping[str, LayerSpec]) -> dict[str, Tensor]:
    """Full-rank state dict from a hybrid (or plain) one: W = A @ B for each factorized layer."""
    full = dict(state)
    for name, spec in plan.items():
        reduce_key, expand_key = factor_keys(name)
        if reduce_key in full:
            full[f"{name}.weight"] = reconstruct(full.pop(reduce_key), full.pop(expand_key), spec.shape)
    return full


def factorize(state: State, plan: Mapping[str, LayerSpec], gammas: Iterable[float]) -> dict[float, dict[str, Tensor]]:
    """State dict of the hybrid model at each rank ratio in ``gammas`` from full-rank ``state``.

    One spectral decomposition per layer at the largest rank needed serves every level by
    truncation (the reference code runs one SVD per layer per level). gamma = 1 gets ``state``
    itself. Returned tensors may share storage with ``state``; treat them as read-only.
    """
    levels = sorted(set(gammas), reverse=True)
    low = [g for g in levels if g < 1]
    out: dict[float, dict[str, Tensor]] = {g: dict(state) for g in levels}
    for name, spec in plan.items():
        weight_key = f"{name}.weight"
        if weight_key not in state:
            raise KeyError(f"full-rank state has no {weight_key!r} for factorized layer {name!r}")
        if not low:
            continue
        a, b = spectral_factors(weight_to_matrix(state[weight_key]), spec.rank(low[0]))
        reduce_key, expand_key = factor_keys(name)
        for gamma in low:
            r = spec.rank(gamma)
            reduce, expand = matrices_to_factors(a[:, :r], b[:r], spec.shape)
            level = out[gamma]
            del level[weight_key]
            level[reduce_key], level[expand_key] = reduce, expand
    return out
