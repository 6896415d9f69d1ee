"""Tensors on the wire: safetensors bytes only, checked against what the receiver expects.

safetensors is a header plus raw buffers: decoding cannot run code (unlike pickle/torch.load) and
costs one copy. The receiver passes the shapes and dtypes it expects, so a payload for the wrong
model or rank is refused with the offending key named instead of failing deep inside training.
fp16 transfer halves the bytes of float tensors; it is off by default because it rounds values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import Tensor

from device_agent.common.tensor_spec import TensorSpec, spec_of
from device_agent.wire.json_bounds import nesting_depth

# safetensors metadata key recording the dtypes that were narrowed to fp16 for transfer.
_CAST_KEY = "fedfleet.fp16_from"
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16)}
_MAX_HEADER_NESTING = 8
# The safetensors dtypes torch loads; anything else is refused before safetensors hands it to torch.
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
    "BOOL": torch.bool,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
}


class CodecError(ValueError):
    """A tensor payload that cannot be decoded or does not match the expected tensors."""

    reason = "bad_payload"


def encode_tensors(tensors: Mapping[str, Tensor], fp16: bool = False) -> bytes:
    """safetensors bytes of ``tensors`` (moved to CPU, made contiguous).

    With ``fp16`` every fp32/fp64/bf16 tensor travels as fp16 and is restored to its dtype on
    decode. A value that does not fit fp16 (|x| > 65504) is an error rather than a silent inf.
    """
    out: dict[str, Tensor] = {}
    narrowed: dict[str, str] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        if fp16 and str(t.dtype) in _DTYPES:
            half = t.to(torch.float16)
            if not torch.isfinite(half).all() and torch.isfinite(t).all():
                raise CodecError(f"tensor {name!r} has values outside the fp16 range; send it without fp16")
            narrowed[name] = str(t.dtype)
            t = half
        out[name] = t
    metadata = {_CAST_KEY: json.dumps(narrowed, sort_keys=True)} if narrowed else None
    return save(out, metadata=metadata)


def decode_tensors(data: bytes, expected: Mapping[str, TensorSpec] | None = None) -> dict[str, Tensor]:
    """Tensors from safetensors bytes, restored to their original dtype, validated against ``expected``.

    ``expected`` (if given) must match exactly: same names, shapes and dtypes. It is checked against the header,
    before any tensor is allocated, so a payload of the wrong model costs no memory.
    """
    header = _header(data)
    narrowed = _narrowed(header)
    if expected is not None:
        check_specs(_specs(header, narrowed), expected)
    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CodecError(f"not a safetensors payload: {exc}") from None
    for name, dtype in narrowed.items():
        if name not in tensors or tensors[name].dtype != torch.float16:
            raise CodecError(f"metadata says {name!r} travelled as fp16, but the payload disagrees")
        tensors[name] = tensors[name].to(dtype)
    return tensors


def header_specs(data: bytes) -> dict[str, TensorSpec]:
    """What a payload holds, read from its header alone (no tensor allocated): names, shapes and the dtypes
    :func:`decode_tensors` restores (a tensor that travelled as fp16 has the dtype it was sent from)."""
    header = _header(data)
    return _specs(header, _narrowed(header))


def check_tensors(tensors: Mapping[str, Tensor], expected: Mapping[str, TensorSpec]) -> None:
    """Raise ``CodecError`` naming the first key that is missing, unexpected or of the wrong shape/dtype."""
    check_specs(spec_of(tensors), expected)


def check_specs(found: Mapping[str, TensorSpec], expected: Mapping[str, TensorSpec]) -> None:
    """:func:`check_tensors` on specs (a header's, or decoded tensors')."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CodecError(f"payload lacks tensor(s) {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise CodecError(
            f"payload has unexpected tensor(s) {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")
        )
    for name, spec in expected.items():
        got = found[name]
        if tuple(got.shape) != tuple(spec.shape):
            raise CodecError(f"tensor {name!r} has shape {tuple(got.shape)}, expected {tuple(spec.shape)}")
        if got.dtype != spec.dtype:
            raise CodecError(f"tensor {name!r} has dtype {got.dtype}, expected {spec.dtype}")


def _specs(header: Mapping[str, Any], narrowed: Mapping[str, torch.dtype]) -> dict[str, TensorSpec]:
    """The tensors a checked header (:func:`_header`) describes, with the dtypes they are restored to."""
    specs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        dims_ok = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        if not dims_ok or info.get("dtype") not in _TORCH_DTYPES:
            raise CodecError(f"not a safetensors payload: header entry {name[:80]!r} is malformed")
        dtype = _TORCH_DTYPES[info["dtype"]]
        if name in narrowed:
            if dtype != torch.float16:
                raise CodecError(f"metadata says {name!r} travelled as fp16, but the payload disagrees")
            dtype = narrowed[name]
        specs[name] = TensorSpec(tuple(shape), dtype)
    missing = sorted(set(narrowed) - set(specs))
    if missing:
        raise CodecError(f"metadata says {missing[0]!r} travelled as fp16, but the payload disagrees")
    return specs


def _header(data: bytes) -> dict[str, Any]:
    """The safetensors header, with what safetensors itself leaves to torch checked first.

    safetensors checks the header length, the JSON and every offset against the buffer, but hands
    dtypes torch lacks (F4, F8_E8M0, ...) and dimensions past int64 to torch, which fails with
    KeyError or TypeError instead of a decoding error.
    """
    header_len = int.from_bytes(data[:8], "little")
    if len(data) < 8 or header_len > len(data) - 8:
        raise CodecError(f"not a safetensors payload: header of {header_len} bytes in a {len(data)}-byte buffer")
    raw = bytes(data[8 : 8 + header_len])
    if nesting_depth(raw) > _MAX_HEADER_NESTING:
        raise CodecError(f"not a safetensors payload: header nested deeper than {_MAX_HEADER_NESTING} levels")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CodecError(f"not a safetensors payload: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CodecError("not a safetensors payload: header is not a JSON object")
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue  # safetensors refuses a malformed entry with its own message
        dtype, shape = info.get("dtype"), info.get("shape")
        if isinstance(dtype, str) and dtype not in _TORCH_DTYPES:
            raise CodecError(f"tensor {name!r} has dtype {dtype!r}, which torch cannot load")
        if isinstance(shape, list) and any(isinstance(d, int) and not 0 <= d < 2**63 for d in shape):
            raise CodecError(f"tensor {name!r} has shape {shape}, with a dimension outside int64")
    return header


def _narrowed(header: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """The fp16 casts recorded in the header by ``encode_tensors``."""
    metadata = header.get("__metadata__") or {}
    if _CAST_KEY not in metadata:
        return {}
    try:
        casts = json.loads(metadata[_CAST_KEY])
        return {name: _DTYPES[dtype] for name, dtype in casts.items()}
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
        raise CodecError(f"bad {_CAST_KEY!r} metadata: {metadata[_CAST_KEY]!r}") from None


__all__ = [
    "CodecError",
    "TensorSpec",
    "check_specs",
    "check_tensors",
    "decode_tensors",
    "encode_tensors",
    "header_specs",
    "spec_of",
]
