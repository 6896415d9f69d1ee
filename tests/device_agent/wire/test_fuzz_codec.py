"""Property: any bytes handed to decode_tensors give tensors or a CodecError, quickly and within a memory bound."""

import json
import struct
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_agent.wire.codec import CodecError, TensorSpec, decode_tensors, encode_tensors

FUZZ = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "I64", "I32", "I16", "I8", "U8"]
DTYPES += ["U16", "U32", "U64", "BOOL", "C64", "complex", "", "f32"]
VALID = encode_tensors({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2)}, fp16=True)


def _safetensors(header: dict, body: bytes, declared_length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if declared_length is None else declared_length) + raw + body


def _decodes_or_refuses(data: bytes) -> None:
    tracemalloc.start()
    try:
        decode_tensors(data)
    except CodecError as exc:
        assert str(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # Whatever the header declares, decoding allocates in proportion to the bytes actually received.
    assert peak < 8 * len(data) + (1 << 20), f"peak {peak} bytes for a {len(data)}-byte payload"


@FUZZ
@given(st.binary(max_size=256))
@example(struct.pack("<Q", 2**64 - 1) + b"{}")
@example(struct.pack("<Q", 2**40) + b'{"a": 1}')
@example(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
def test_arbitrary_bytes_decode_or_raise_codec_error(data):
    _decodes_or_refuses(data)


@FUZZ
@given(st.integers(0, len(VALID)), st.integers(0, len(VALID) - 1), st.integers(0, 255))
def test_truncated_or_flipped_payloads_decode_or_raise_codec_error(cut, position, value):
    _decodes_or_refuses(VALID[:cut])
    flipped = bytearray(VALID)
    flipped[position] = value
    _decodes_or_refuses(bytes(flipped))


tensor_entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPES),
        "shape": st.lists(st.sampled_from([0, 1, 2, 3, 7, 2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**64 - 1]), max_size=4),
        "data_offsets": st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 64), min_size=2, max_size=2),
    }
)
metadata = st.dictionaries(st.just("fedfleet.fp16_from"), st.text(max_size=40) | st.just('{"t": "torch.float32"}'))


@FUZZ
@given(
    st.dictionaries(st.text(min_size=1, max_size=6), tensor_entries, max_size=3),
    metadata,
    st.binary(max_size=64),
    st.none() | st.integers(0, 2**64 - 1),
)
@example({"t": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}}, {}, b"", None)
@example({"t": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, {}, b"\x02\x00\xff", None)
@example({"t": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, {}, b"\x7f\xff", None)
@example({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, {"fedfleet.fp16_from": "[1]"}, b"abcd", None)
def test_crafted_headers_decode_or_raise_codec_error(tensors, meta, body, declared_length):
    header = {**tensors, "__metadata__": meta} if meta else tensors
    _decodes_or_refuses(_safetensors(header, body, declared_length))


@FUZZ
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4) | st.sampled_from([2**62, 2**63, 2**64 - 1]), max_size=3),
    st.binary(max_size=48),
)
@example("F8_E8M0", [2], b"\x01\x01")  # safetensors knows it, torch does not: was a KeyError
@example("F4", [2], b"\x01")
@example("F32", [0, 2**64 - 1], b"")  # zero elements, but a dimension past int64: was a TypeError
@example("F32", [2**63, 0], b"")
def test_headers_whose_offsets_cover_the_body_decode_or_raise_codec_error(dtype, shape, body):
    _decodes_or_refuses(_safetensors({"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(body)]}}, body))


def test_a_nested_header_is_refused_before_json_parses_it():
    with pytest.raises(CodecError, match="nested deeper"):
        header = b'{"__metadata__": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        decode_tensors(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("declared", [2**63, 2**64 - 1, 100])
def test_a_header_length_past_the_buffer_is_refused(declared):
    with pytest.raises(CodecError, match="not a safetensors payload"):
        decode_tensors(_safetensors({}, b"", declared_length=declared))


def test_decoded_payload_is_checked_against_the_expected_specs():
    with pytest.raises(CodecError, match="tensor 'w' has shape"):
        decode_tensors(VALID, {"w": TensorSpec((4, 3), torch.float32), "b": TensorSpec((2,), torch.float32)})
