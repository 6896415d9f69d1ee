"""Width multiplier shared by every model: HeteroFL/FedRolex sub-models keep ceil(C * rate) channels."""

from __future__ import annotations

import math


def scaled_channels(channels: int, width: float) -> int:
    """ceil(C * width), at least 1; the small epsilon keeps e.g. 0.35 * 100 = 35.000000000000004 at 35."""
    return max(1, math.ceil(channels * width - 1e-9))
