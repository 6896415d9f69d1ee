"""An assignment's tensors checked against the model the device builds for it, before anything is loaded.

``load_state_dict`` casts what it is given: complex to real (with only a warning), float64, float16
and integers to float32, bools to 0/1. A payload from a buggy or hostile coordinator, or one built
for another model, would then train something other than what was sent. Checked first, it fails
the round with ``bad_assignment`` instead, naming the offending tensors and what was expected.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

MAX_NAMED = 5
"""How many offending tensors one message names; the rest are counted."""


class BadAssignment(ValueError):
    """Assignment tensors that do not fit the device's model: the round fails with ``bad_assignment``."""


@dataclass(frozen=True)
class Input:
    """A tensor an assignment carries besides the model's (SimFed's criteria batch); None in ``shape`` is any size."""

    shape: tuple[int | None, ...]
    dtype: torch.dtype = torch.float32


def check_assignment(
    tensors: Mapping[str, Tensor],
    model: Mapping[str, Tensor],
    optional: Collection[str] = (),
    inputs: Mapping[str, Input] | None = None,
) -> None:
    """Raise ``BadAssignment`` unless ``tensors`` fit ``model`` (a state dict) and ``inputs``.

    Every key of ``model`` not in ``optional`` and every input must be there, and nothing else.
    Each tensor must have its reference's shape and dtype (an integer buffer, such as BatchNorm's
    ``num_batches_tracked``, any integer dtype), and floating values must be finite.
    """
    inputs = inputs or {}
    required = [key for key in model if key not in optional] + list(inputs)
    missing = sorted(key for key in required if key not in tensors)
    unexpected = sorted(set(tensors) - set(model) - set(inputs))
    misfits = []
    for key in sorted(set(tensors) - set(unexpected)):
        problem = _misfit(tensors[key], model[key] if key in model else inputs[key])
        if problem:
            misfits.append(f"{key!r} {problem}")
    problems = [f"missing {_named(missing)}"] if missing else []
    problems += [f"not in the model: {_named(unexpected)}"] if unexpected else []
    problems += misfits[:MAX_NAMED]
    if len(misfits) > MAX_NAMED:
        problems.append(f"{len(misfits) - MAX_NAMED} more tensors that do not fit")
    if problems:
        raise BadAssignment(f"assignment does not fit the model: {'; '.join(problems)}")


def _named(keys: list[str]) -> str:
    named = ", ".join(repr(key) for key in keys[:MAX_NAMED])
    return named + (f" and {len(keys) - MAX_NAMED} more" if len(keys) > MAX_NAMED else "")


def _misfit(tensor: Tensor, reference: Tensor | Input) -> str | None:
    """What is wrong with one received tensor, or None."""
    shape, dtype = tuple(reference.shape), reference.dtype
    dims = zip(shape, tensor.shape, strict=False)
    if len(shape) != tensor.dim() or any(want is not None and want != got for want, got in dims):
        return f"has shape {tuple(tensor.shape)}, expected {_shape(shape)}"
    if tensor.dtype != dtype and not (_is_integer(dtype) and _is_integer(tensor.dtype)):
        return f"is {tensor.dtype}, expected {f'an integer dtype like {dtype}' if _is_integer(dtype) else dtype}"
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        return f"has {int((~torch.isfinite(tensor)).sum())} non-finite values"
    return None


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _shape(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("any" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


__all__ = ["BadAssignment", "Input", "check_assignment"]
