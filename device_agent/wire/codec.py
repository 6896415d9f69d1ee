"""Tensors on the wire: safetensors bytes only, checked against what the receiver expects.

safetensors is a header plus raw buffers: decoding cannot run code (unlike pickle/torch.load) and
costs one copy. The receiver passes the shapes and dtypes it expects, so a payload for the wrong
model or rank is refused with the offending key named instead of failing deep inside training.
fp16 transfer halves the bytes of float tensors; it is off by default because it rounds values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import Tensor

from device_agent.wire.json_bounds import nesting_depth

# safetensors metadata key recording the dtypes that were narrowed to fp16 for transfer.
_CAST_KEY = "fedfleet.fp16_from"
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16)}
# The safetensors dtypes torch loads; anything else is refused before safetensors hands it to torch.
_WIRE_DTYPES = frozenset(
    {
        "F64",
        "F32",
        "F16",
        "BF16",
        "F8_E4M3",
        "F8_E5M2",
        "C64",
        "BOOL",
        "I64",
        "I32",
        "I16",
        "I8",
        "U64",
        "U32",
        "U16",
        "U8",
    }
)
_MAX_HEADER_NESTING = 8


class CodecError(ValueError):
    """A tensor payload that cannot be decoded or does not match the expected tensors."""


@dataclass(frozen=True)
class TensorSpec:
    """What the receiver expects one tensor to be."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def spec_of(tensors: Mapping[str, Tensor]) -> dict[str, TensorSpec]:
    """The spec a receiver can hold to validate a payload built from tensors like these."""
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in tensors.items()}


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

    ``expected`` (if given) must match exactly: same names, shapes and dtypes.
    """
    header = _header(data)
    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CodecError(f"not a safetensors payload: {exc}") from None
    narrowed = _narrowed(header)
    for name, dtype in narrowed.items():
        if name not in tensors or tensors[name].dtype != torch.float16:
            raise CodecError(f"metadata says {name!r} travelled as fp16, but the payload disagrees")
        tensors[name] = tensors[name].to(dtype)
    if expected is not None:
        check_tensors(tensors, expected)
    return tensors


def check_tensors(tensors: Mapping[str, Tensor], expected: Mapping[str, TensorSpec]) -> None:
    """Raise ``CodecError`` naming the first key that is missing, unexpected or of the wrong shape/dtype."""
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CodecError(f"payload lacks tensor(s) {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CodecError(
            f"payload has unexpected tensor(s) {', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")
        )
    for name, spec in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(spec.shape):
            raise CodecError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(spec.shape)}")
        if t.dtype != spec.dtype:
            raise CodecError(f"tensor {name!r} has dtype {t.dtype}, expected {spec.dtype}")


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
        if isinstance(dtype, str) and dtype not in _WIRE_DTYPES:
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
