import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_agent.secagg.errors import ParameterError, QuantizationError
from device_agent.secagg.quantize import Quantizer, from_bytes, to_bytes


def test_modulus_holds_the_sum_of_every_device():
    quantizer = Quantizer(clip=1.0, bits=16, devices=300)
    assert quantizer.modulus_bits == 16 + 9  # ceil(log2 300) = 9
    assert 300 * quantizer.levels < 2**quantizer.modulus_bits
    assert Quantizer(clip=1.0, bits=16, devices=256).modulus_bits == 24


@given(
    devices=st.integers(1, 60),
    bits=st.integers(4, 24),
    clip=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_decoded_sum_is_within_the_stated_bound(devices, bits, clip, seed):
    quantizer = Quantizer(clip=clip, bits=bits, devices=devices)
    inputs = np.random.default_rng(seed).uniform(-clip, clip, size=(devices, 17))
    inputs[0, :2] = [-clip, clip]  # the range's ends are inside it
    total = sum(quantizer.encode(row) for row in inputs)
    decoded = quantizer.decode_sum(total, devices)
    assert np.max(np.abs(decoded - inputs.sum(axis=0))) <= quantizer.error_bound(devices) * (1 + 1e-9)


def test_sum_wraps_modulo_the_ring_and_still_decodes():
    quantizer = Quantizer(clip=2.0, bits=8, devices=4)
    inputs = np.array([[1.5, -2.0], [0.25, 2.0], [-1.0, 0.0]])
    masks = np.random.default_rng(1).integers(0, 2**63, size=(3, 2), dtype=np.uint64)
    masked = [quantizer.encode(x) + m for x, m in zip(inputs, masks, strict=True)]
    total = sum(masked) - sum(masks)  # numpy uint64 wraps: arithmetic modulo 2^64, hence modulo 2^k
    assert np.allclose(quantizer.decode_sum(total, 3), inputs.sum(axis=0), atol=quantizer.error_bound(3))


def test_out_of_range_input_is_refused_naming_the_range_unless_clipped():
    quantizer = Quantizer(clip=0.5, bits=8, devices=3)
    with pytest.raises(QuantizationError, match=r"magnitude 0\.7 outside the quantization range \[-0\.5, 0\.5\]"):
        quantizer.encode([0.1, -0.7])
    assert quantizer.encode([0.1, -0.7], clip=True)[1] == 0
    edge = np.float32(0.5) + np.float32(0.5) * np.float32(2**-23)  # the float32 just above the bound
    assert quantizer.encode(np.array([edge, -edge], dtype=np.float32)).tolist() == [quantizer.levels, 0]
    with pytest.raises(QuantizationError, match="non-finite"):
        quantizer.encode([np.nan, 0.0], clip=True)


def test_overflowed_sum_is_an_error_not_a_wrong_average():
    quantizer = Quantizer(clip=1.0, bits=8, devices=4)
    with pytest.raises(QuantizationError, match="exceeds 510 = 2 devices x 255 levels"):
        quantizer.decode_sum(np.array([600], dtype=np.uint64), 2)
    with pytest.raises(QuantizationError, match=r"sized for 1\.\.4"):
        quantizer.decode_sum(np.array([0], dtype=np.uint64), 5)


def test_parameters_out_of_range_name_the_parameter():
    with pytest.raises(ParameterError, match=r"^clip"):
        Quantizer(clip=0.0, bits=8, devices=3)
    with pytest.raises(ParameterError, match=r"^bits: 48 bits for 100000 devices need a 65-bit modulus"):
        Quantizer(clip=1.0, bits=48, devices=100_000)
    with pytest.raises(ParameterError, match=r"^devices"):
        Quantizer(clip=1.0, bits=8, devices=0)


@pytest.mark.parametrize("modulus_bits, width", [(25, 4), (32, 4), (33, 8), (64, 8)])
def test_vector_bytes_use_the_narrowest_word(modulus_bits, width):
    vector = np.array([0, 2**modulus_bits - 1, 12345], dtype=np.uint64)
    data = to_bytes(vector, modulus_bits)
    assert len(data) == 3 * width
    assert np.array_equal(from_bytes(data, modulus_bits, 3), vector)
    with pytest.raises(QuantizationError, match="4 elements"):
        from_bytes(data, modulus_bits, 4)
