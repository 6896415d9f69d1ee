"""``device-agent infer``'s input range: float pixels outside [0, 1] are refused, not silently misread."""

from __future__ import annotations

import numpy as np
import pytest

from device_agent.infer import InferenceError, ModelInfo, preprocess

INFO = ModelInfo((1, 8, 8), [str(i) for i in range(10)], 1 / 255, [0.0], [1.0], {})


def test_raw_digits_on_their_0_16_scale_are_refused_with_the_fix() -> None:
    raw = np.arange(64, dtype=np.float64).reshape(8, 8) % 17  # scikit-learn digits: 0..16
    expected = r"digit\.npy: float pixels must lie in \[0, 1\].*got 0 to 16.*divide by 16"
    with pytest.raises(InferenceError, match=expected):
        preprocess(raw, INFO, "digit.npy")


def test_unit_floats_and_uint8_are_the_same_input() -> None:
    pixels = (np.arange(64).reshape(8, 8) * 4).astype(np.uint8)
    as_float = pixels.astype(np.float32) / 255
    np.testing.assert_allclose(preprocess(pixels, INFO), preprocess(as_float, INFO), atol=1e-6)


def test_non_finite_pixels_are_refused() -> None:
    with pytest.raises(InferenceError, match="finite"):
        preprocess(np.full((8, 8), np.nan, dtype=np.float32), INFO)
