"""User-level differential privacy on the device: the whole round's contribution clipped before it leaves.

The coordinator aggregates the contribution in the full-rank space: a dense tensor as it is, a FedHM factor
pair ``<layer>.reduce`` / ``<layer>.expand`` as the product A @ B. So the update is measured there, all
layers as one vector:

    Delta = concat over layers of (trained - sent),  with  A'B' - AB  for a factor pair,
    s = min(1, C / ||Delta||_2).

The upload is then what was sent plus ``s * Delta``, written in the strategy's own form: a dense tensor as
``sent + s * (trained - sent)``; a factor pair as factors of rank 2r, ``[A, A'] @ [(1 - s) B; s B']``,
which multiply out to ``AB + s (A'B' - AB)`` exactly (a rank-r pair cannot hold that sum). What leaves the
device is a function of the clipped update only; the coordinator checks the bound again (docs/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from device_agent.layers.factorized import factors_to_matrices

REDUCE, EXPAND = ".reduce", ".expand"


class CannotClip(ValueError):
    """The upload has a tensor the device was not sent in the same form: its update cannot be measured."""


@dataclass(frozen=True)
class Clipped:
    upload: dict[str, Tensor]
    norm: float
    """L2 norm of the update before clipping (stays on the device)."""
    unclipped: bool
    """The update was within the norm (adaptive clipping's bit, sent noised-over by the coordinator's count)."""


def factor_pairs(upload: Mapping[str, Tensor]) -> dict[str, tuple[str, str]]:
    """Layer name -> (reduce key, expand key) for every factor pair in ``upload``."""
    return {
        key.removesuffix(REDUCE): (key, key.removesuffix(REDUCE) + EXPAND)
        for key in upload
        if key.endswith(REDUCE) and key.removesuffix(REDUCE) + EXPAND in upload
    }


def _sent_like(key: str, value: Tensor, sent: Mapping[str, Tensor]) -> Tensor:
    reference = sent.get(key)
    if reference is None or reference.shape != value.shape:
        raise CannotClip(f"{key!r}: not sent to this device in this shape, so its update cannot be clipped")
    return reference


def update_norm(sent: Mapping[str, Tensor], upload: Mapping[str, Tensor]) -> float:
    """||Delta||_2 of the module doc, in float64."""
    pairs = factor_pairs(upload)
    in_pairs = {k for pair in pairs.values() for k in pair}
    total = 0.0
    for key, value in upload.items():
        if key in in_pairs or not value.is_floating_point():
            continue
        total += float((value.to(torch.float64) - _sent_like(key, value, sent).to(torch.float64)).square().sum())
    for reduce_key, expand_key in pairs.values():
        a1, b1 = factors_to_matrices(upload[reduce_key].to(torch.float64), upload[expand_key].to(torch.float64))
        a0, b0 = factors_to_matrices(
            _sent_like(reduce_key, upload[reduce_key], sent).to(torch.float64),
            _sent_like(expand_key, upload[expand_key], sent).to(torch.float64),
        )
        total += float((a1 @ b1 - a0 @ b0).square().sum())
    return math.sqrt(total)


def clip_update(sent: Mapping[str, Tensor], upload: Mapping[str, Tensor], clip_norm: float) -> Clipped:
    """``upload`` as sent plus the update scaled to L2 norm at most ``clip_norm`` (module doc)."""
    norm = update_norm(sent, upload)
    scale = 1.0 if norm <= clip_norm else clip_norm / norm
    pairs = factor_pairs(upload)
    in_pairs = {k for pair in pairs.values() for k in pair}
    out: dict[str, Tensor] = {}
    for key, value in upload.items():
        if key in in_pairs or not value.is_floating_point():
            out[key] = value
            continue
        reference = sent[key].to(torch.float64)
        out[key] = (reference + scale * (value.to(torch.float64) - reference)).to(value.dtype)
    for reduce_key, expand_key in pairs.values():
        reduce, expand = upload[reduce_key], upload[expand_key]
        out[reduce_key] = torch.cat([(1 - scale) * sent[reduce_key], scale * reduce], dim=0).to(reduce.dtype)
        out[expand_key] = torch.cat([sent[expand_key], expand], dim=1).to(expand.dtype)
    return Clipped(out, norm, norm <= clip_norm)


__all__ = ["CannotClip", "Clipped", "clip_update", "factor_pairs", "update_norm"]
