import pytest
import torch

from device_agent.wire import codec
from device_agent.wire.codec import CodecError, TensorSpec, decode_tensors, encode_tensors, header_specs, spec_of


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "layer.reduce": torch.randn(8, 3, 1, 3, generator=gen),
        "layer.expand": torch.randn(256, 8, 3, 1, generator=gen),
        "bn.num_batches_tracked": torch.tensor(7),
    }


def test_tensors_round_trip_exactly_and_match_their_spec():
    tensors = _tensors()
    decoded = decode_tensors(encode_tensors(tensors), spec_of(tensors))
    assert set(decoded) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(decoded[name], tensor)


def test_fp16_transfer_halves_floats_and_restores_their_dtype():
    tensors = _tensors()
    full, half = encode_tensors(tensors), encode_tensors(tensors, fp16=True)
    assert len(half) < 0.6 * len(full)
    decoded = decode_tensors(half, spec_of(tensors))
    assert decoded["layer.reduce"].dtype == torch.float32
    torch.testing.assert_close(decoded["layer.reduce"], tensors["layer.reduce"], rtol=1e-3, atol=1e-3)
    assert torch.equal(decoded["bn.num_batches_tracked"], tensors["bn.num_batches_tracked"])


def test_values_beyond_fp16_are_refused_rather_than_sent_as_inf():
    with pytest.raises(CodecError, match="fp16 range"):
        encode_tensors({"w": torch.tensor([1e6])}, fp16=True)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s.pop("layer.expand"), "unexpected tensor.*layer.expand"),
        (lambda s: s.update(extra=TensorSpec((1,), torch.float32)), "lacks tensor.*extra"),
        (lambda s: s.update({"layer.reduce": TensorSpec((4, 3, 1, 3), torch.float32)}), "layer.reduce.*shape"),
        (lambda s: s.update({"layer.reduce": TensorSpec((8, 3, 1, 3), torch.float64)}), "layer.reduce.*dtype"),
    ],
)
def test_decode_refuses_a_payload_that_is_not_what_the_receiver_expects(change, problem):
    tensors = _tensors()
    expected = spec_of(tensors)
    change(expected)
    with pytest.raises(CodecError, match=problem):
        decode_tensors(encode_tensors(tensors), expected)


def test_unexpected_tensors_and_garbage_are_refused():
    tensors = _tensors()
    expected = spec_of(tensors)
    del expected["bn.num_batches_tracked"]
    with pytest.raises(CodecError, match="unexpected tensor"):
        decode_tensors(encode_tensors(tensors), expected)
    with pytest.raises(CodecError, match="not a safetensors payload"):
        decode_tensors(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")


def test_the_header_says_what_a_payload_holds_and_a_mismatch_is_refused_before_it_is_loaded(monkeypatch):
    tensors = _tensors()
    half = encode_tensors(tensors, fp16=True)
    assert header_specs(half) == spec_of(tensors)  # the dtypes it is restored to, not fp16
    monkeypatch.setattr(codec, "load", lambda data: pytest.fail("a payload off its spec was loaded"))
    with pytest.raises(CodecError, match=r"'layer.reduce' has shape \(8, 3, 1, 3\), expected \(4, 3, 1, 3\)"):
        decode_tensors(half, {**spec_of(tensors), "layer.reduce": TensorSpec((4, 3, 1, 3), torch.float32)})
