"""Uploads the gate must refuse, made from a device's real one (for links that tamper in transit)."""

from __future__ import annotations

import math

import torch

from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.payload import Received


def with_nan(received: Received) -> Received:
    """The same upload with its first tensor all NaN, digested again so only the gate's finiteness check refuses it."""
    tensors = decode_tensors(received.data)
    key = next(iter(tensors))
    return received.replaced(data=encode_tensors({**tensors, key: torch.full_like(tensors[key], math.nan)}))
