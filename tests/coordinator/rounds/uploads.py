"""Uploads the gate must refuse, made from a device's real one (for links that tamper in transit)."""

from __future__ import annotations

import math

import torch

from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.transfer import Completed, make_manifest


def with_nan(completed: Completed) -> Completed:
    """The same upload with its first tensor all NaN, re-sealed so only the gate's finiteness check refuses it."""
    tensors = decode_tensors(completed.data)
    key = next(iter(tensors))
    data = encode_tensors({**tensors, key: torch.full_like(tensors[key], math.nan)})
    m = completed.manifest
    return Completed(make_manifest(data, run=m.run, round=m.round, kind=m.kind, meta=m.meta), [data])
