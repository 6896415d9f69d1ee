"""What the upload gate checks on top of the envelope and the strategy: meta bounds, dtypes and norms.

Everything in an upload comes from one device and is checked before the journal, so a round
close can never fail because of one device's values: every number of the meta within its range of
:data:`device_agent.wire.bounds.UPLOAD_META` (``parse_upload_meta``), the sample counts also within a
multiple of the device's share. Every refusal is an :class:`UploadRefused`
with a short snake_case ``reason`` from :data:`REASONS` (a bounded label set for metrics).

The norm bound compares an update's L2 norm with a reference: the norm of what the device was
sent for the same tensors (known from the first upload of a round on), else the median norm of
the updates already accepted at the same level; with neither (e.g. a personalized strategy whose
device keeps what it uploads) the first upload of a level passes.

That bound compares the upload with the weights, so it cannot tell -9.5x the weights sent (an
update of 10.5x) from an honest upload. The update bound does (:func:`update_bounds`): each layer's update
(upload minus sent, full rank) has a reference, the median norm of that layer's accepted updates of the
previous rounds (:class:`~coordinator.algorithms.robust.NormHistory`; never this round's, so no upload's
bound depends on which arrived first), never below ``update_reference_floor`` of the highest that median has
been in the run (a converged model's median collapses while its worst-fit honest device still moves), scaled to
the device's samples (x sqrt(samples / the fleet's typical samples): more data, more steps, a longer update); the
update as a whole, the root mean square of its moving
layers' ratios to their references, is held to ``update_bound_factor`` and each layer alone to
``update_layer_bound_factor``, clipped to them or refused. One layer of an honest update can jump (3.6x its
reference in the demo) where the whole update does not (2.0x), while a boosted update is large in every layer.
Until a layer has a median (the first round of a run), the layers without one may move by
``update_warmup_factor`` x the norm of what was sent, together.

A norm bound cannot see direction: a sign-flipped update has an honest norm. The direction check
refuses (``wrong_direction``) an update, as it would be folded, whose cosine with the fleet's direction
of last round (:class:`~coordinator.algorithms.robust.DirectionReference`, full rank) is below
``direction_min_cosine``; the first round of a run has no reference and is not checked. Consecutive
rounds can point apart on non-IID data, so that check is opt-in; the peer check is on by default: each
update leaves a direction sketch (:func:`~coordinator.algorithms.robust.sketch`) and at the close
:meth:`UploadGate.peer_outliers` names those whose cosine with the sum of the round's others is below
``peer_hard_floor``, or below ``peer_min_cosine`` in a round whose updates agree (the caller takes them out of
the aggregate).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.algorithms.robust import (
    DirectionReference,
    NormHistory,
    Outlier,
    PeerHistory,
    apply_steps,
    clip_layer,
    dense,
    dense_updates,
    iterated_outliers,
    layer_norms,
    layers_of,
    peer_cosines,
    round_deviations,
    sketch,
)
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
        "wrong_direction",
        "wrong_kind",
        "wrong_run",
        "wrong_round",
        "too_stale",
        "not_participant",
        "wrong_sender",
        "bad_message",
        "rejected",
        "other",
    }
)
"""Every reason code the engine counts a refused upload under (``RoundEngine.refusals``)."""


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
    """Sample counts relative to this device's share: the schema's absolute ranges allow any device a billion."""
    most = max(1, math.ceil(expected_samples * settings.max_samples_factor))
    claims = [("samples", meta.samples)]
    if meta.received is not None:
        claims.append(("eval_samples", meta.received.samples))
    for name, value in claims:
        if value > most:
            raise UploadRefused(
                "bad_meta", f"{name}={value} is over {settings.max_samples_factor:g}x the {expected_samples} expected"
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


@dataclass(frozen=True)
class Screened:
    """An upload past the norm checks: what to fold (clipped where ``steps`` says) and its norms."""

    upload: dict[str, Tensor]
    norm: float
    """L2 norm of the upload as sent (the reference of :func:`norm_reference`)."""
    update_norms: dict[str, float] = field(default_factory=dict)
    """Per moving layer (:meth:`UploadGate._moving`), the norm of the update as folded (after clipping)."""
    steps: dict[str, float] = field(default_factory=dict)
    """Layers clipped, with the fraction of their update kept."""
    cosine: float | None = None
    """The update's cosine with the fleet's reference direction (None: not checked, e.g. the first round)."""
    direction: dict[str, Tensor] = field(default_factory=dict, repr=False)
    """Per layer, the update as folded (full rank): what :meth:`UploadGate.accepted` adds to the reference."""
    sketch: Tensor | None = field(default=None, repr=False)
    """The update's direction sketch, for the peer check at the round's close (None: not checked)."""
    scale: float = 1.0
    """The device's :func:`sample_scale`: its update norms enter the fleet's history divided by it."""


def update_bounds(
    norms: Mapping[str, float],
    sent: Mapping[str, Tensor],
    history: NormHistory,
    settings: GateSettings,
    moving: Collection[str] = (),
    scale: float = 1.0,
) -> dict[str, float]:
    """Per layer, how far its update may go (module doc). A layer with a median: at most ``update_layer_bound_factor``
    x its reference (``scale`` x the median, or x ``update_reference_floor`` of the layer's highest median in the
    run where that is more), then all of them the share that brings the root mean square of the
    ``moving`` layers' ratios to their references down to ``update_bound_factor`` where it is over. The others: a
    share of the warm-up bound.

    A layer the fleet lately left unchanged (median 0: BatchNorm biases of devices whose one image gives no
    gradient) has no scale to judge by: k x 0 clipped every update of it to nothing, so the warm-up bound
    applies to it instead.
    """
    factor, layer = settings.update_bound_factor or math.inf, settings.update_layer_bound_factor or math.inf
    floor = settings.update_reference_floor or 0.0
    references = {
        name: scale * max(median, floor * history.peak(name)) for name in norms if (median := history.median(name))
    }
    capped = {name: min(norms[name], layer * reference) for name, reference in references.items()}
    ratios = [capped[name] / references[name] for name in moving if name in references]
    rms = math.sqrt(sum(r * r for r in ratios) / len(ratios)) if ratios else 0.0
    share = min(1.0, factor / rms) if rms > 0 else 1.0
    bounds = {name: share * norm for name, norm in capped.items()}
    warm = [name for name in norms if name not in bounds]
    if warm:
        layers = layers_of(sent)
        sent_norm = math.sqrt(sum(float(sent[k].to(torch.float64).square().sum()) for n in warm for k in layers[n]))
        update_norm = math.sqrt(sum(norms[name] ** 2 for name in warm))
        scale = min(1.0, settings.update_warmup_factor * max(sent_norm, settings.norm_floor) / max(update_norm, 1e-30))
        bounds.update({name: scale * norms[name] for name in warm})
    return bounds


def sample_scale(samples: int | None, expected: int | None) -> float:
    """How much longer an honest update of ``samples`` is than one of the ``expected`` samples (sqrt of the ratio:
    between a random walk's and a straight line's growth with the steps taken); 1 when either is unknown."""
    if not samples or not expected:
        return 1.0
    return math.sqrt(samples / expected)


class UploadGate:
    """The round-scoped part of the gate (what each device was sent, the norms accepted so far) and
    the fleet's recent update norms per layer, kept across rounds."""

    def __init__(self, settings: GateSettings | None = None) -> None:
        self.settings = settings or GateSettings()
        self._sent: dict[str, dict[str, float]] = {}
        self._sent_tensors: dict[str, Mapping[str, Tensor]] = {}
        self._accepted: dict[float, list[float]] = {}
        self.history = NormHistory(self.settings.update_history_rounds, self.settings.update_history_min)
        self.direction = DirectionReference()
        self.records = PeerHistory(self.settings.peer_record_rounds, self.settings.peer_record_prior)
        """Per device, its updates' deviations from their rounds' median cosine (the peer check's record)."""
        self._sketches: dict[str, Tensor] = {}
        self._outliers: dict[str, str] | None = None
        """The open round's peer check, once judged (:meth:`peer_outliers`): a round adds to the records once."""
        self._sent_layer_norms: dict[int, dict[str, float]] = {}
        """Per payload sent this round (by id: the tensors are shared and held in ``_sent_tensors``), layer norms."""

    def open_round(self) -> None:
        self._sent.clear()
        self._sent_layer_norms.clear()
        self._sketches.clear()
        self._outliers = None
        self._sent_tensors.clear()
        self._accepted.clear()
        self.history.next_round()
        self.direction.next_round()

    def sent(self, device: str, norms: Mapping[str, float], tensors: Mapping[str, Tensor] | None = None) -> None:
        """Record what ``device`` was assigned: squared norms (:func:`squared_norms`) and the tensors (both shared
        per payload); without the tensors its update cannot be bounded."""
        self._sent[device] = dict(norms)
        if tensors is not None:
            self._sent_tensors[device] = tensors

    def meta(self, meta: Mapping[str, str], expected_samples: int) -> UploadMeta:
        """The parsed, bounded meta of an upload."""
        check_meta_size(meta, self.settings)
        parsed = parse_upload_meta(meta)
        check_meta_values(parsed, expected_samples, self.settings)
        return parsed

    def norm(self, device: str, level: float, upload: Mapping[str, Tensor], scale: float = 1.0) -> Screened:
        """The upload refused when beyond a bound, or as it may be folded (clipped); call after the strategy
        found it finite. ``scale``: the device's :func:`sample_scale`."""
        norms = squared_norms(upload)
        value = math.sqrt(sum(norms.values()))
        check_norm(value, norm_reference(norms, self._sent.get(device), self._accepted.get(level, [])), self.settings)
        sent = self._sent_tensors.get(device)
        directed = self.settings.direction_min_cosine is not None or self.settings.peer_min_cosine is not None
        if sent is None or (self.settings.update_bound_factor is None and not directed):
            return Screened(dict(upload), value, scale=scale)
        direction = dense_updates(upload, sent)
        updates = layer_norms(direction)
        moving = self._moving(updates, sent)
        over: dict[str, float] = {}
        if self.settings.update_bound_factor is not None:
            bounds = update_bounds(updates, sent, self.history, self.settings, moving, scale)
            over = {name: bounds[name] for name in updates if updates[name] > bounds[name] * (1 + 1e-6)}
        if not over:
            return self._directed(Screened(dict(upload), value, moving, scale=scale), direction)
        if self.settings.update_bound_action == "refuse":
            name = max(over, key=lambda n: updates[n] / max(over[n], 1e-30))
            raise UploadRefused(
                "norm_too_large",
                f"{name!r}: update norm {updates[name]:.4g} is over its bound {over[name]:.4g} (the whole update "
                f"over {self.settings.update_bound_factor:g}x the fleet's recent median, a layer over "
                f"{self.settings.update_layer_bound_factor or math.inf:g}x, or the warm-up bound)",
            )
        layers = layers_of(upload)
        steps = {name: clip_layer(upload, sent, layers[name], bound) for name, bound in over.items()}
        clipped = apply_steps(upload, sent, steps)
        direction |= dense_updates({key: clipped[key] for name in steps for key in layers[name]}, sent)
        folded = self._moving(layer_norms(direction), sent)
        return self._directed(Screened(clipped, value, folded, steps, scale=scale), direction)

    def _moving(self, updates: dict[str, float], sent: Mapping[str, Tensor]) -> dict[str, float]:
        """The layers of ``updates`` that moved more than ``update_still_ratio`` x their norm as sent: only these
        enter the fleet's median (a still layer says nothing of how far an informative update goes)."""
        sent_norms = self._sent_layer_norms.get(id(sent))
        if sent_norms is None:  # once per payload: a round's devices share a few
            layers = layers_of(sent).items()
            sent_norms = {name: float(torch.linalg.vector_norm(dense(sent, keys))) for name, keys in layers}
            self._sent_layer_norms[id(sent)] = sent_norms
        ratio = self.settings.update_still_ratio
        return {name: norm for name, norm in updates.items() if norm > ratio * sent_norms.get(name, 0.0)}

    def _directed(self, screened: Screened, direction: dict[str, Tensor]) -> Screened:
        """The direction check: refuse an update pointing away from the fleet's (module doc); sketch it for the
        peer check. ``direction``: the screened upload's :func:`dense_updates`."""
        if self.settings.direction_min_cosine is None and self.settings.peer_min_cosine is None:
            return screened
        peer = None if self.settings.peer_min_cosine is None else sketch(direction)
        if self.settings.direction_min_cosine is None:
            return replace(screened, sketch=peer)
        cos = self.direction.cosine(direction)
        if cos is not None and cos < self.settings.direction_min_cosine:
            raise UploadRefused(
                "wrong_direction",
                f"update has cosine {cos:.3g} with the fleet's direction of last round "
                f"(at least {self.settings.direction_min_cosine:g})",
            )
        return replace(screened, cosine=cos, direction=direction, sketch=peer)

    def replayed(
        self, device: str, upload: Mapping[str, Tensor], sent: Mapping[str, Tensor], scale: float = 1.0
    ) -> Screened:
        """A journaled upload as a resume folds it. The norm bound judged it when it came (the journal keeps it as
        folded, clipped or not); its direction is measured again from ``sent`` (what the device was assigned this
        round), so the peer check at the close judges it like a live one. ``scale``: as :meth:`norm`'s."""
        self.sent(device, squared_norms(sent), sent)
        direction = dense_updates(upload, sent)
        value = math.sqrt(sum(squared_norms(upload).values()))
        moving = self._moving(layer_norms(direction), sent)
        return self._directed(Screened(dict(upload), value, moving, scale=scale), direction)

    def accepted(self, level: float, screened: Screened, device: str | None = None) -> None:
        self._accepted.setdefault(level, []).append(screened.norm)
        self.history.add({name: n / screened.scale for name, n in screened.update_norms.items()}, device or "")
        if screened.direction:
            self.direction.add(screened.direction)
        if device is not None and screened.sketch is not None:
            self._sketches[device] = screened.sketch

    def refused_at_close(self, device: str) -> None:
        """``device``'s update, accepted earlier this round, was refused at the close: its norms leave the history."""
        self.history.forget(device)

    def peer_cosines(self) -> dict[str, float]:
        """Per device, its update's cosine with the sum of the round's others (module doc); empty while the check
        is off or fewer than ``peer_min_updates`` uploads were screened here (a resume's replayed ones count)."""
        if self.settings.peer_min_cosine is None or len(self._sketches) < self.settings.peer_min_updates:
            return {}
        return peer_cosines(self._sketches)

    def peer_outliers(self) -> dict[str, str]:
        """The round's updates below ``peer_hard_floor``, or, in a round that agrees, below ``peer_min_cosine`` and
        ``peer_spread`` deviations below the round's median (:func:`~coordinator.algorithms.robust.peer_cut`), or
        whose device's record lies over ``peer_record_gap`` under its rounds' median, taken out one at a time with
        every cosine computed again without them (:func:`~coordinator.algorithms.robust.iterated_outliers`), fewer
        than half, with why. Judged once a round: the round's deviations then join the devices' records."""
        if self._outliers is None:
            self._outliers = self._judge_peers()
        return dict(self._outliers)

    def _judge_peers(self) -> dict[str, str]:
        settings = self.settings
        floor = settings.peer_min_cosine
        if floor is None or len(self._sketches) < settings.peer_min_updates:
            return {}
        hard, agreement = settings.peer_hard_floor, settings.peer_min_agreement
        rule = f"below {floor:g}" + (
            f" and {settings.peer_spread:g} deviations below the round's median" if settings.peer_spread else ""
        )
        if agreement is not None:
            rule += f" where the round's median is at least {agreement:g}"
        outlier = None
        if settings.peer_outlier_deviations is not None:
            outlier = Outlier(settings.peer_outlier_deviations, settings.peer_outlier_gap)
            rule += (
                f", or {outlier.deviations:g} deviations (at least {outlier.gap:g}) below the median of a round that "
                "agrees"
            )
        if hard is not None:
            rule += f"; below {hard:g} in any round"
        gap = settings.peer_record_gap
        removed = iterated_outliers(
            self._sketches,
            floor,
            settings.peer_spread,
            hard_floor=hard,
            agreement=agreement,
            outlier=outlier,
            history=self.records,
            history_gap=gap,
        )
        self.records.record(round_deviations(self._sketches, [r.device for r in removed], agreement))
        reasons: dict[str, str] = {}
        for r in removed:
            if r.score is None:
                reasons[r.device] = (
                    f"update has cosine {r.cosine:.3g} with the sum of the round's other updates "
                    f"(at least {r.cut:.3g}: {rule})"
                )
            else:
                reasons[r.device] = (
                    f"its updates lie {-r.score:.3g} under their rounds' median cosine with the others, on average "
                    f"over its last rounds (at most {gap:g}); this one's cosine {r.cosine:.3g}"
                )
        return reasons

    def noise_std(self, folded: int) -> float | None:
        """Per weight, the std of the round's weak noise (``update_noise`` x the norm of the fleet's median update of
        the previous rounds / the updates folded), or None: off, nothing folded, or no median yet (the first round)."""
        z, scale = self.settings.update_noise, self.history.median_update_norm()
        if not z or folded < 1 or scale is None:
            return None
        return z * scale / folded

    def sample_weight(self, claimed: int, expected_samples: int) -> int:
        """The samples an upload is weighted by: what it claims, capped at ``sample_weight_factor`` x expected."""
        if self.settings.sample_weight_factor is None:
            return claimed
        return min(claimed, max(1, math.ceil(expected_samples * self.settings.sample_weight_factor)))
