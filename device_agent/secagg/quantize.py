"""Fixed-point quantization of float vectors into Z_(2^k), the ring masks live in.

A device maps each value x in [-clip, clip] to q = round((x + clip) / step), step = 2 clip / (2^bits - 1),
so q is in [0, 2^bits - 1]. The sum of n devices' q is at most n (2^bits - 1) < 2^k with
k = bits + ceil(log2 n): masked sums taken modulo 2^k then decode exactly to the sum of the q's, and the
decoded float sum is within n * step / 2 of the true sum (round to nearest: at most half a step per value;
``error_bound`` also covers the float32 slack of the range check).

Values outside [-clip, clip] are refused (``QuantizationError``) unless the caller asks to clip them: a
silently clipped update is a different update. Non-finite values are always refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from device_agent.secagg.errors import ParameterError, QuantizationError

RANGE_SLACK = 2.0**-20
"""Relative tolerance of the range check: far above float32's rounding (2^-24), far below a quantization step."""
MAX_MODULUS_BITS = 64
"""Arithmetic runs in numpy uint64, which wraps modulo 2^64; 2^k divides it for every k <= 64."""


@dataclass(frozen=True)
class Quantizer:
    """``clip``: values must lie in [-clip, clip]; ``bits``: levels per value; ``devices``: how many may be summed."""

    clip: float
    bits: int
    devices: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ParameterError(f"clip: must be a finite number > 0, got {self.clip}")
        if not 1 <= self.bits <= 48:
            raise ParameterError(f"bits: must be in 1..48, got {self.bits}")
        if self.devices < 1:
            raise ParameterError(f"devices: must be >= 1, got {self.devices}")
        if self.modulus_bits > MAX_MODULUS_BITS:
            raise ParameterError(
                f"bits: {self.bits} bits for {self.devices} devices need a {self.modulus_bits}-bit modulus "
                f"(bits + ceil(log2 devices)); at most {MAX_MODULUS_BITS}"
            )

    @property
    def levels(self) -> int:
        """The largest quantized value of one device."""
        return (1 << self.bits) - 1

    @property
    def modulus_bits(self) -> int:
        """k: the smallest ring Z_(2^k) in which the sum of ``devices`` quantized values cannot wrap."""
        return self.bits + (self.devices - 1).bit_length()

    @property
    def step(self) -> float:
        return 2 * self.clip / self.levels

    def error_bound(self, count: int) -> float:
        """The largest difference, per element, between a decoded sum of ``count`` devices and the true sum.

        Half a step per device from rounding; a value within the range check's slack above ``clip`` is clamped
        to it and then quantized exactly, so it is off by at most ``clip * RANGE_SLACK`` (below half a step for
        bits <= 20).
        """
        return count * max(self.step / 2, self.clip * RANGE_SLACK)

    def encode(self, values: ArrayLike, clip: bool = False) -> np.ndarray:
        """``values`` (flat or not) as a flat uint64 vector in [0, levels]; out of range refused unless ``clip``."""
        array = np.asarray(values, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(array)):
            raise QuantizationError(f"input has {int(np.sum(~np.isfinite(array)))} non-finite values")
        # A bound met in float32 (an update clipped on the device to norm `clip`) can exceed the float64 bound
        # by a rounding: within RANGE_SLACK of it a value is in range, and clamped like the rest.
        if not clip and array.size and float(np.max(np.abs(array))) > self.clip * (1 + RANGE_SLACK):
            worst = float(np.max(np.abs(array)))
            raise QuantizationError(
                f"input value of magnitude {worst:.6g} outside the quantization range [-{self.clip}, {self.clip}] "
                "(raise clip, or clip the update on the device before masking)"
            )
        array = np.clip(array, -self.clip, self.clip)
        return np.rint((array + self.clip) / self.step).astype(np.uint64)

    def decode_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The float sum of ``count`` devices' inputs from the sum of their quantized vectors (mod 2^k)."""
        if not 1 <= count <= self.devices:
            raise QuantizationError(f"sum of {count} devices: this quantizer is sized for 1..{self.devices}")
        reduced = np.asarray(total, dtype=np.uint64) & np.uint64((1 << self.modulus_bits) - 1)
        ceiling = count * self.levels
        if reduced.size and int(reduced.max()) > ceiling:
            raise QuantizationError(
                f"sum element {int(reduced.max())} exceeds {ceiling} = {count} devices x {self.levels} levels: "
                "a mask was not removed or an input was out of range"
            )
        return reduced.astype(np.float64) * self.step - count * self.clip


def to_bytes(vector: np.ndarray, modulus_bits: int) -> bytes:
    """A Z_(2^k) vector in little-endian words of 4 bytes (k <= 32) or 8 bytes: what a masked upload carries."""
    dtype = "<u4" if modulus_bits <= 32 else "<u8"
    return np.asarray(vector, dtype=np.uint64).astype(dtype).tobytes()


def from_bytes(data: bytes, modulus_bits: int, length: int) -> np.ndarray:
    dtype = "<u4" if modulus_bits <= 32 else "<u8"
    width = np.dtype(dtype).itemsize
    if len(data) != length * width:
        raise QuantizationError(f"masked vector of {len(data)} bytes; {length} elements x {width} bytes expected")
    return np.frombuffer(data, dtype=dtype).astype(np.uint64)
