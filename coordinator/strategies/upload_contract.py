"""The upload a strategy expects from one device, declared once: every tensor's name, shape and dtype.

``Strategy.upload_contract(slot)`` returns it. The upload gate reads a payload's safetensors header against
it before any tensor is allocated (:meth:`UploadContract.check_specs` on
:func:`~device_agent.wire.codec.header_specs`), then checks the values (:meth:`UploadContract.check_values`):
finite, bounded, index lists in range. An aggregate folds what passed and checks none of it again.
:meth:`UploadContract.check` runs both on tensors already in memory (tests, examples, :meth:`RoundAggregate.add`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected, check_values
from device_agent.common.tensor_spec import TensorSpec, spec_of

INDEX_DTYPE = torch.int64
"""The dtype of an index list (a device's classes)."""


@dataclass(frozen=True)
class UploadContract:
    """What one device sends back: ``tensors`` (the upload) and ``extras`` (side information) exactly, and
    ``index_lists``: extras that list distinct indices below a bound, of any length up to it (its classes)."""

    tensors: Mapping[str, TensorSpec]
    extras: Mapping[str, TensorSpec] = field(default_factory=dict)
    index_lists: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def like(
        cls,
        tensors: Mapping[str, Tensor],
        extras: Mapping[str, Tensor] | None = None,
        index_lists: Mapping[str, int] | None = None,
    ) -> UploadContract:
        """The contract of uploads shaped like ``tensors`` (values are never read: meta tensors do)."""
        return cls(spec_of(tensors), spec_of(extras or {}), dict(index_lists or {}))

    def with_extras(self, extras: Mapping[str, TensorSpec]) -> UploadContract:
        """This contract with more side information (a wrapper's, e.g. the privacy layer's clipped bit)."""
        return UploadContract(self.tensors, {**self.extras, **extras}, self.index_lists)

    def check_specs(self, upload: Mapping[str, TensorSpec], extras: Mapping[str, TensorSpec]) -> None:
        """Names, shapes and dtypes, from a header or from tensors; ``UpdateRejected`` names the first tensor off."""
        _check_names("", upload, self.tensors)
        for key, bound in self.index_lists.items():
            spec = extras.get(key)
            if spec is None:
                raise UpdateRejected(f"{key!r}: this strategy needs the device's {key} in its extras", "missing_tensor")
            if spec.dtype != INDEX_DTYPE or len(spec.shape) != 1:
                got = f"{spec.dtype} of shape {tuple(spec.shape)}"
                raise UpdateRejected(f"{key!r}: expected a 1-D {INDEX_DTYPE} list of indices, got {got}", "bad_dtype")
            if spec.shape[0] > bound:
                raise UpdateRejected(f"{key!r}: {spec.shape[0]} entries, at most {bound}", "out_of_bounds")
        other = {k: v for k, v in extras.items() if k not in self.index_lists}
        unknown = sorted(other.keys() - self.extras.keys())
        if unknown:
            takes = ", ".join(sorted([*self.extras, *self.index_lists])) or "none"
            raise UpdateRejected(
                f"{unknown[0][:80]!r}: side information this strategy does not take ({takes})", "unknown_tensor"
            )
        _check_names("extras ", other, self.extras)

    def check_values(self, upload: Mapping[str, Tensor], extras: Mapping[str, Tensor]) -> None:
        """Every float tensor finite and bounded (:func:`check_values`), every index list in range, each once."""
        for prefix, tensors in (("", upload), ("extras ", extras)):
            for key, value in tensors.items():
                if value.is_floating_point():
                    check_values(f"{prefix}{key}", value, value.dtype)
        for key, bound in self.index_lists.items():
            indices = extras[key]
            if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= bound):
                raise UpdateRejected(f"{key!r}: indices must lie in [0, {bound})", "out_of_bounds")
            if len(indices.unique()) != len(indices):
                raise UpdateRejected(f"{key!r}: an index is listed twice", "out_of_bounds")

    def check(self, upload: Mapping[str, Tensor], extras: Mapping[str, Tensor] | None = None) -> None:
        """:meth:`check_specs` then :meth:`check_values`, on tensors in memory."""
        extras = extras or {}
        for key, value in (*upload.items(), *extras.items()):
            if not isinstance(value, Tensor):
                raise UpdateRejected(f"{key!r}: expected a tensor, got {type(value).__name__}", "bad_payload")
        self.check_specs(spec_of(upload), spec_of(extras))
        self.check_values(upload, extras)


def _check_names(prefix: str, found: Mapping[str, TensorSpec], expected: Mapping[str, TensorSpec]) -> None:
    unknown = sorted(found.keys() - expected.keys())
    if unknown:
        raise UpdateRejected(
            f"{prefix}{unknown[0][:80]!r}: not a tensor a device at this level sends", "unknown_tensor"
        )
    missing = sorted(expected.keys() - found.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UpdateRejected(f"{prefix}{missing[0]!r}: missing from the upload{more}", "missing_tensor")
    for key, want in expected.items():
        got = found[key]
        if got.dtype != want.dtype:
            raise UpdateRejected(f"{prefix}{key!r}: dtype {got.dtype}, expected {want.dtype}", "bad_dtype")
        if tuple(got.shape) != tuple(want.shape):
            raise UpdateRejected(
                f"{prefix}{key!r}: shape {tuple(got.shape)}, expected {tuple(want.shape)}", "bad_shape"
            )
