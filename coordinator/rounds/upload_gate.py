"""What the upload gate checks on top of the envelope and the strategy: meta bounds, dtypes and norms.

Everything in an upload comes from one device and is checked before the journal, so a round
close can never fail because of one device's values. Every refusal is an :class:`UploadRefused`
with a short snake_case ``reason`` from :data:`REASONS` (a bounded label set for metrics).

The norm bound compares an update's L2 norm with a reference: the norm of what the device was
sent for the same tensors (known from the first upload of a round on), else the median norm of
the updates already accepted at the same level; with neither (e.g. a personalized strategy whose
device keeps what it uploads) the first upload of a level passes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.limits import GateSettings
from device_agent.common.profile import DeviceProfile
from device_agent.wire.protocol import UploadMeta, parse_upload_meta

REASONS = frozenset(
    {
        "bad_meta",
        "bad_payload",
        "bad_dtype",
        "bad_shape",
        "missing_tensor",
        "unknown_tensor",
        "non_finite",
        "out_of_bounds",
        "norm_too_large",
        "wrong_kind",
        "wrong_run",
        "wrong_round",
        "not_participant",
        "wrong_sender",
        "bad_message",
        "rejected",
        "other",
    }
)
"""Every reason code the engine counts a refused upload under (``RoundEngine.refusals``)."""

FLOAT_DTYPE = torch.float32
"""The dtype of every model tensor: an upload in another float type (float64, bfloat16, float8) is refused."""
INTEGER_DTYPES = (torch.int64, torch.int32)
"""Integer side information (class lists, BatchNorm step counters)."""


class UploadRefused(UpdateRejected):
    """An upload the gate refuses; ``reason`` is its code in :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        super().__init__(message)
        self.reason = reason


def check_meta_size(meta: Mapping[str, str], settings: GateSettings) -> None:
    """Bound the manifest meta itself before parsing it: a few short entries."""
    if len(meta) > settings.max_meta_entries:
        raise UploadRefused(
            "bad_meta", f"update manifest meta has {len(meta)} entries (at most {settings.max_meta_entries})"
        )
    long = [key for key, value in meta.items() if len(key) + len(value) > settings.max_meta_chars]
    if long:
        raise UploadRefused(
            "bad_meta", f"update manifest meta entry {long[0][:40]!r} is over {settings.max_meta_chars} characters"
        )


def check_meta_values(meta: UploadMeta, expected_samples: int, settings: GateSettings) -> None:
    """Bounds ``parse_upload_meta`` leaves open: seconds, loss and samples a device cannot plausibly report."""
    if meta.train_seconds > settings.max_train_seconds:
        raise UploadRefused(
            "bad_meta", f"train_seconds={meta.train_seconds:.6g} exceeds the bound of {settings.max_train_seconds:g} s"
        )
    if abs(meta.loss) > settings.max_abs_loss:
        raise UploadRefused("bad_meta", f"loss={meta.loss:.6g} exceeds the bound of {settings.max_abs_loss:g}")
    most = max(1, math.ceil(expected_samples * settings.max_samples_factor))
    if meta.samples > most:
        raise UploadRefused(
            "bad_meta",
            f"samples={meta.samples} is over {settings.max_samples_factor:g}x the {expected_samples} expected",
        )


def profile_problem(profile: DeviceProfile) -> str | None:
    """What makes a hello's profile unusable for planning (JSON lets ``Infinity`` and ``NaN`` through), or None."""

    def walk(value: object, path: str) -> str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return f"{path} = {value}"
        if isinstance(value, dict):
            return next((p for k, v in value.items() if (p := walk(v, f"{path}.{k}" if path else k))), None)
        if isinstance(value, list | tuple):
            return next((p for i, v in enumerate(value) if (p := walk(v, f"{path}[{i}]"))), None)
        return None

    found = walk(profile.model_dump(), "")
    return None if found is None else f"a non-finite profile value ({found})"


def check_dtypes(tensors: Mapping[str, Tensor]) -> None:
    """Every float tensor in the model's dtype, every other one an integer kind: before any arithmetic on them."""
    for key, value in tensors.items():
        if not isinstance(value, Tensor):
            raise UploadRefused("bad_payload", f"{key!r}: expected a tensor, got {type(value).__name__}")
        if value.is_floating_point() and value.dtype != FLOAT_DTYPE:
            raise UploadRefused("bad_dtype", f"{key!r}: dtype {value.dtype}, expected {FLOAT_DTYPE}")
        if not value.is_floating_point() and value.dtype not in INTEGER_DTYPES:
            raise UploadRefused("bad_dtype", f"{key!r}: dtype {value.dtype} is neither {FLOAT_DTYPE} nor an integer")


def squared_norms(tensors: Mapping[str, Tensor]) -> dict[str, float]:
    """Per float tensor, its squared L2 norm (in float64: a float32 sum of squares overflows at |x| ~ 1e19)."""
    return {k: float(v.to(torch.float64).square().sum()) for k, v in tensors.items() if v.is_floating_point()}


def norm_reference(
    upload: Mapping[str, float], sent: Mapping[str, float] | None, accepted: list[float]
) -> float | None:
    """The norm an honest update of these tensors is compared with (module doc), or None when there is none."""
    if sent is not None:
        shared = [sent[key] for key in upload if key in sent]
        if shared and sum(shared) > 0:
            return math.sqrt(sum(shared))
    if accepted:
        return statistics.median(accepted)
    return None


def check_norm(norm: float, reference: float | None, settings: GateSettings) -> None:
    if settings.max_norm_ratio is None or reference is None or reference <= 0:
        return
    reference = max(reference, settings.norm_floor)
    if norm > settings.max_norm_ratio * reference:
        raise UploadRefused(
            "norm_too_large",
            f"update norm {norm:.4g} is {norm / reference:.3g}x its reference {reference:.4g} "
            f"(bound {settings.max_norm_ratio:g}x)",
        )


class UploadGate:
    """The round-scoped part of the gate: what each device was sent and the norms accepted so far."""

    def __init__(self, settings: GateSettings | None = None) -> None:
        self.settings = settings or GateSettings()
        self._sent: dict[str, dict[str, float]] = {}
        self._accepted: dict[float, list[float]] = {}

    def open_round(self) -> None:
        self._sent.clear()
        self._accepted.clear()

    def sent(self, device: str, norms: Mapping[str, float]) -> None:
        """Record the squared norms of what ``device`` was assigned (:func:`squared_norms`, shared per payload)."""
        self._sent[device] = dict(norms)

    def meta(self, meta: Mapping[str, str], expected_samples: int) -> UploadMeta:
        """The parsed, bounded meta of an upload."""
        check_meta_size(meta, self.settings)
        parsed = parse_upload_meta(meta)
        check_meta_values(parsed, expected_samples, self.settings)
        return parsed

    def norm(self, device: str, level: float, upload: Mapping[str, Tensor]) -> float:
        """The update's norm, refused when beyond the bound; call after the strategy found it finite."""
        norms = squared_norms(upload)
        value = math.sqrt(sum(norms.values()))
        check_norm(value, norm_reference(norms, self._sent.get(device), self._accepted.get(level, [])), self.settings)
        return value

    def accepted(self, level: float, norm: float) -> None:
        self._accepted.setdefault(level, []).append(norm)
