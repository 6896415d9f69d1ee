"""What a receiver expects one tensor to be: the shape and dtype, no values.

Below the wire and the strategies both: the codec checks a payload's header against it, a strategy declares
its upload with it (``coordinator.strategies.upload_contract``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """What the receiver expects one tensor to be."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def spec_of(tensors: Mapping[str, Tensor]) -> dict[str, TensorSpec]:
    """The spec a receiver can hold to validate a payload built from tensors like these."""
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in tensors.items()}
