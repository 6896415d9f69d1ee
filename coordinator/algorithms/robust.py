"""Robust aggregation: bound each device's update, per layer, in the full-rank space.

An update is what a device uploads minus what it was sent. A layer a client sends as low-rank
factors (``<layer>.reduce`` / ``<layer>.expand``, FedHM) is compared as its product A @ B, the
dense weight the strategy aggregates, so scaling one factor by -9.5 counts as the dense change it
makes. Norm clipping (Sun et al. 2019, "Can you really backdoor federated learning?") streams: it
needs one update at a time and the fleet's recent update norms, so it fits every strategy's fold.

The round's own direction (:func:`sketch`, :func:`peer_cosines`) also streams: each update leaves a
small fixed-size sketch of its direction, and at the round's close every update is compared with the
sum of the others' (leave one out), so the reference is this round's fleet, whatever last round did.

The buffered rules at the end (coordinate-wise median, trimmed mean, multi-Krum) need every
update of a round at once; see docs/robust-aggregation.md for what each defends against.
"""

from __future__ import annotations

import bisect
import math
import statistics
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from device_agent.layers.factorized import factors_to_matrices, weight_to_matrix

REDUCE, EXPAND = ".reduce", ".expand"


def layers_of(tensors: Mapping[str, Tensor]) -> dict[str, tuple[str, ...]]:
    """Layer name -> the upload keys that make it: a factor pair, or one float tensor (its own name)."""
    layers: dict[str, tuple[str, ...]] = {}
    for key, value in tensors.items():
        if not value.is_floating_point():
            continue
        if key.endswith(REDUCE) and key.removesuffix(REDUCE) + EXPAND in tensors:
            name = key.removesuffix(REDUCE)
            layers[name] = (key, name + EXPAND)
        elif not (key.endswith(EXPAND) and key.removesuffix(EXPAND) + REDUCE in tensors):
            layers[key] = (key,)
    return layers


def dense(tensors: Mapping[str, Tensor], keys: tuple[str, ...]) -> Tensor:
    """One layer in float64 as the strategy aggregates it: A @ B for a factor pair, else the tensor."""
    if len(keys) == 2:
        a, b = factors_to_matrices(tensors[keys[0]].to(torch.float64), tensors[keys[1]].to(torch.float64))
        return a @ b
    return tensors[keys[0]].to(torch.float64)


def dense_updates(upload: Mapping[str, Tensor], sent: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per layer, upload minus sent in the full-rank space (float64).

    Layers the device was not sent in the same form (shapes differ, keys missing: a personalized
    part it keeps) have no update to measure and are left out.
    """
    updates: dict[str, Tensor] = {}
    for name, keys in layers_of(upload).items():
        if any(k not in sent or sent[k].shape != upload[k].shape for k in keys):
            continue
        updates[name] = dense(upload, keys) - dense(sent, keys)
    return updates


def layer_norms(updates: Mapping[str, Tensor]) -> dict[str, float]:
    """Per layer, the L2 norm of :func:`dense_updates`' result (computed once, then also sketched)."""
    return {name: float(torch.linalg.vector_norm(u)) for name, u in updates.items()}


def clip_layer(upload: Mapping[str, Tensor], sent: Mapping[str, Tensor], keys: tuple[str, ...], bound: float) -> float:
    """The step t in [0, 1] so that sent + t * (upload - sent) moves this layer by at most ``bound``.

    Exact for a dense tensor (t = bound / norm). For a factor pair both factors move by t, so the
    dense change t * X + t^2 * Y is not linear in t: bisection finds the largest t within the bound.
    """
    base = dense(sent, keys)
    full = float(torch.linalg.vector_norm(dense(upload, keys) - base))
    if full <= bound:
        return 1.0
    if len(keys) == 1:
        return bound / full
    low, high = 0.0, 1.0
    for _ in range(30):
        mid = (low + high) / 2
        moved = {k: sent[k].to(torch.float64) + mid * (upload[k].to(torch.float64) - sent[k]) for k in keys}
        if float(torch.linalg.vector_norm(dense(moved, keys) - base)) <= bound:
            low = mid
        else:
            high = mid
    return low


def apply_steps(
    upload: Mapping[str, Tensor], sent: Mapping[str, Tensor], steps: Mapping[str, float]
) -> dict[str, Tensor]:
    """``upload`` with each layer in ``steps`` moved only that fraction of the way from what was sent."""
    out = dict(upload)
    layers = layers_of(upload)
    for name, step in steps.items():
        for key in layers[name]:
            out[key] = (sent[key] + step * (upload[key] - sent[key])).to(upload[key].dtype)
    return out


class NormHistory:
    """Per layer, the update norms accepted over the last ``rounds`` closed rounds: the fleet's reference.

    The median is what an honest update of this layer looks like lately; a minority of devices
    cannot move it, whatever they send (its breakdown point is one half). Only closed rounds count:
    the norms of the open round join the median when it closes (:meth:`next_round`), so a round's
    bounds do not depend on which of its uploads arrived first, and an attacker gains nothing by
    arriving early. A device's norms refused at the close (:meth:`forget`) never join it.

    It also keeps each layer's :meth:`peak`, the highest its median has been in the run: as a model converges most
    devices barely move and the median falls 10-30 fold, while a device the model still fits worse moves about as
    far as the fleet did early on (the update bound's floor, :func:`coordinator.rounds.upload_gate.update_bounds`).
    """

    def __init__(self, rounds: int, min_updates: int) -> None:
        if rounds < 1 or min_updates < 1:
            raise ValueError(f"rounds and min_updates must be >= 1, got {rounds} and {min_updates}")
        self.min_updates = min_updates
        self._closed: deque[dict[str, list[float]]] = deque(maxlen=rounds)
        self._open: dict[str, dict[str, float]] = {}
        """Device -> its layers' norms, accepted in the open round (not yet in the median)."""
        # Per layer, every norm of the closed rounds kept sorted: the median is read for every upload, and sorting
        # the window each time made a 1,000-device round slower with each round the window filled.
        self._sorted: dict[str, list[float]] = {}
        self._peaks: dict[str, float] = {}

    def next_round(self) -> None:
        """The open round's norms join the median (a round that accepted none leaves the window as it was)."""
        norms: dict[str, list[float]] = {}
        for device_norms in self._open.values():
            for name, value in device_norms.items():
                norms.setdefault(name, []).append(value)
        self._open = {}
        if norms:
            self._push(norms)
            self._raise_peaks()

    def _push(self, norms: Mapping[str, Sequence[float]]) -> None:
        if len(self._closed) == self._closed.maxlen:
            for name, values in self._closed[0].items():
                window = self._sorted[name]
                for value in values:
                    del window[bisect.bisect_left(window, value)]
        self._closed.append({name: [float(v) for v in values] for name, values in norms.items()})
        for name, values in norms.items():
            for value in values:
                bisect.insort(self._sorted.setdefault(name, []), float(value))

    def _raise_peaks(self) -> None:
        for name in self._sorted:
            if (median := self.median(name)) is not None and median > self._peaks.get(name, 0.0):
                self._peaks[name] = median

    def add(self, norms: Mapping[str, float], device: str = "") -> None:
        """One accepted update's layer norms, counted from the next round on (a device's second update of a round
        replaces its first)."""
        self._open[device or f"#{len(self._open)}"] = dict(norms)

    def forget(self, device: str) -> None:
        """Drop ``device``'s norms of the open round: its update was refused at the close."""
        self._open.pop(device, None)

    def window(self) -> list[dict[str, list[float]]]:
        """The accepted norms of each round in the window, oldest first, the open round's last: what a resumed run
        restores (saved at a round's close, so the last is the round just closed)."""
        rounds = [{name: list(values) for name, values in norms.items()} for norms in self._closed]
        current: dict[str, list[float]] = {}
        for device_norms in self._open.values():
            for name, value in device_norms.items():
                current.setdefault(name, []).append(value)
        return rounds + ([current] if current else [])

    def peaks(self) -> dict[str, float]:
        """Per layer, the highest median of the run so far (what a resumed run restores with the window)."""
        return dict(self._peaks)

    def peak(self, name: str) -> float:
        """The highest median layer ``name`` has had in the run (0 before it had one)."""
        return self._peaks.get(name, 0.0)

    def restore(
        self, window: Sequence[Mapping[str, Sequence[float]]], peaks: Mapping[str, float] | None = None
    ) -> None:
        """Start again from a :meth:`window` saved earlier: its newest ``rounds`` rounds, all of them closed, and
        the :meth:`peaks` saved with it. The window's rounds are pushed at once: medians of its first rounds
        alone never existed in the run and must not raise a peak."""
        self._closed.clear()
        self._sorted.clear()
        self._open = {}
        self._peaks = {name: float(value) for name, value in (peaks or {}).items()}
        for norms in list(window)[-(self._closed.maxlen or 1) :]:
            self._push(norms)
        self._raise_peaks()

    def median_update_norm(self) -> float | None:
        """The norm of an update whose every layer moves by its median (over the layers with one), or None."""
        medians = [m for name in self._sorted if (m := self.median(name)) is not None]
        return math.sqrt(sum(m * m for m in medians)) if medians else None

    def median(self, name: str) -> float | None:
        """The median norm of layer ``name`` over the closed rounds of the window, or None while fewer than
        ``min_updates`` are known."""
        window = self._sorted.get(name, [])
        count = len(window)
        if count < self.min_updates:
            return None
        middle = count // 2
        return window[middle] if count % 2 else (window[middle - 1] + window[middle]) / 2


def noised(
    state: Mapping[str, Tensor], keys: Iterable[str], std: float, normal: Callable[[tuple[int, ...], float], Tensor]
) -> dict[str, Tensor]:
    """``state`` with N(0, std^2) added to every weight of ``keys`` (``normal(shape, std)`` draws it, in float64)."""
    out = dict(state)
    for key in keys:
        out[key] = (state[key].to(torch.float64) + normal(tuple(state[key].shape), std)).to(state[key].dtype)
    return out


def total_norm(tensors: Iterable[Tensor]) -> float:
    """The L2 norm of the tensors as one vector, in float64 (a float32 sum of squares overflows at |x| ~ 1e19)."""
    return math.sqrt(sum(float(t.to(torch.float64).square().sum()) for t in tensors))


def cosine(update: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> float | None:
    """Cosine similarity of two per-layer updates over the layers both have (same shape), as one vector.

    None when they share no layer or either is zero there: no direction to compare.
    """
    shared = [n for n in update if n in reference and reference[n].shape == update[n].shape]
    dot = sum(float((update[n].to(torch.float64) * reference[n].to(torch.float64)).sum()) for n in shared)
    left = total_norm(update[n] for n in shared)
    right = total_norm(reference[n] for n in shared)
    if not shared or left == 0 or right == 0:
        return None
    return dot / (left * right)


def full_rank_form(name: str, value: Tensor) -> tuple[str, Tensor]:
    """A layer's update under the name and shape a factor pair's A @ B has (:func:`dense`): a dense
    ``X.weight`` of a linear layer becomes ``X``, a square-kernel convolution's ``X.weight`` also its
    (C_out k, C_in k) matrix; other tensors are left as they are.

    So a full-rank device's ``conv2.weight`` and a low-rank device's ``conv2`` meet in one sketch: sketched under
    their own names, the update of FedHM's largest layers was compared only between devices of like rank, and
    on a mixed-rank fleet every cosine between levels was read from the small unfactorized layers alone.
    """
    square = value.dim() == 2 or (value.dim() == 4 and value.shape[2] == value.shape[3])  # what FedHM factorizes
    if name.endswith(".weight") and square:
        return name.removesuffix(".weight"), weight_to_matrix(value)
    return name, value


def full_rank_forms(update: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every layer of ``update`` in :func:`full_rank_form`."""
    return dict(full_rank_form(name, value) for name, value in update.items())


class DirectionReference:
    """The fleet's recent update direction, per layer: the sum of last round's accepted updates, each
    scaled to unit norm, in full-rank form (:func:`full_rank_form`: FedHM's ``conv2.weight`` and a low-rank
    device's ``conv2`` factors add up under one name).

    Unit-scaled so that one update counts as one vote whatever its size: a large reversed update in
    the warm-up round (before the norm bound has a median) cannot turn the reference around. It
    streams: one running sum the size of the model, no upload kept. Until a round has been accepted
    (the first round of a run, or of a resumed coordinator) there is no reference.
    """

    def __init__(self) -> None:
        self.reference: dict[str, Tensor] = {}
        self._sum: dict[str, Tensor] = {}

    def next_round(self) -> None:
        """Last round's sum becomes the reference (a round that accepted nothing keeps the one before)."""
        if self._sum:
            self.reference, self._sum = self._sum, {}

    def add(self, update: Mapping[str, Tensor]) -> None:
        """Count one accepted update (:func:`dense_updates`) as one unit vote, in its full-rank form."""
        norm = total_norm(update.values())
        if norm == 0 or not math.isfinite(norm):
            return
        for name, value in full_rank_forms(update).items():
            unit = value.to(torch.float32) / norm
            if name not in self._sum:
                self._sum[name] = unit
            elif self._sum[name].shape == unit.shape:  # another shape under the same name is not comparable
                self._sum[name] += unit

    def cosine(self, update: Mapping[str, Tensor]) -> float | None:
        """The update's cosine with the reference (:func:`cosine`, in full-rank form), or None without one."""
        return cosine(full_rank_forms(update), self.reference) if self.reference else None


SKETCH_SIZE = 4096
"""Buckets of a direction sketch: a cosine read from two sketches is within about 0.02 of the true one."""


HASH_CACHE_BYTES = 128 * 2**20
"""Bucket and sign tables kept between uploads (16 bytes an element). Drawing them again for every upload
took a fifth of a 300-device coordinator's time per upload; past this budget a layer's are drawn each time."""


class _HashTables:
    """Per layer, its bucket and sign tables, drawn once while they fit :data:`HASH_CACHE_BYTES`."""

    def __init__(self, budget: int = HASH_CACHE_BYTES) -> None:
        self.budget = budget
        self._tables: dict[tuple[str, int, int], tuple[Tensor, Tensor]] = {}
        self._bytes = 0

    def get(self, key: str, numel: int, size: int) -> tuple[Tensor, Tensor]:
        tables = self._tables.get((key, numel, size))
        if tables is None:
            tables = _draw_hashes(key, numel, size)
            if self._bytes + 16 * numel <= self.budget:
                self._tables[(key, numel, size)] = tables
                self._bytes += 16 * numel
        return tables


def _draw_hashes(key: str, numel: int, size: int) -> tuple[Tensor, Tensor]:
    """Per element of a layer, its bucket and its sign: drawn from a generator seeded by the layer's name and
    shape, so every update of the run hashes the same way."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    bucket = torch.randint(size, (numel,), generator=generator)
    sign = torch.randint(2, (numel,), generator=generator, dtype=torch.float64).mul_(2).sub_(1)
    return bucket, sign


_hashes = _HashTables()


def sketch(update: Mapping[str, Tensor], size: int = SKETCH_SIZE) -> Tensor:
    """A CountSketch (Charikar et al. 2002) of the update scaled to unit norm: ``size`` numbers whose dot
    products estimate the cosines of the full updates, so a round keeps one small vector per device.

    Layers are hashed by name and shape in their full-rank form (:func:`full_rank_form`), so a full-rank
    weight and a factor pair's product of the same layer meet, and layers of other names or shapes do not;
    a zero or non-finite update sketches to 0.
    """
    norm = total_norm(update.values())
    out = torch.zeros(size, dtype=torch.float64)
    if norm == 0 or not math.isfinite(norm):
        return out
    for name, value in full_rank_forms(update).items():
        bucket, sign = _hashes.get(f"{name}:{tuple(value.shape)}", value.numel(), size)
        out.index_add_(0, bucket, value.reshape(-1).to(torch.float64) * sign / norm)
    return out


DUPLICATE_COSINE = 0.95
"""Two updates whose sketches agree this closely count as one vote (FoolsGold, Fung et al. 2020): honest
devices training on their own data do not send near-copies, colluders sending one update do. Nor exact
reversals: copies of one honest update reversed are no independent vote on it either, so they are left out too."""


def peer_cosines(sketches: Mapping[str, Tensor], duplicate: float = DUPLICATE_COSINE) -> dict[str, float]:
    """Per device, the cosine of its update with the sum of the round's other updates (leave one out).

    Each update counts as one unit vote, so one large update cannot turn the others' sum; updates within
    ``duplicate`` cosine of a device's own (or of its reverse) are left out of its reference with it, so
    colluders sending the same update do not vote for each other, nor copies of an update reversed vote it
    out. A device whose peers' sum is zero (or who has no peer) gets no cosine.
    """
    if not sketches:
        return {}
    devices = list(sketches)
    stacked = torch.stack([sketches[d] for d in devices])
    norms = stacked.norm(dim=1).clamp_min(1e-30)
    pairwise = (stacked @ stacked.T) / torch.outer(norms, norms)
    group = (pairwise.abs() >= duplicate).to(torch.float64)
    group.fill_diagonal_(1.0)
    rest = stacked.sum(dim=0) - group @ stacked
    cosines: dict[str, float] = {}
    for index, device in enumerate(devices):
        scale = float(stacked[index].norm() * rest[index].norm())
        if scale > 0:
            cosines[device] = float(stacked[index] @ rest[index]) / scale
    return cosines


class PeerHistory:
    """Per device, how far its updates lay under their rounds' median cosine (:func:`peer_cosines`), over the last
    ``rounds`` rounds that agreed: a device's record, where one round says little.

    A backdoor device's update is a genuine training update: in any one round it can read no lower than an honest
    device's of unusual data (label skew), but it reads low in every round, its data's pull repeated; an honest
    device's unusual rounds come and go. :meth:`score` is the mean with ``prior`` rounds of 0 added, so one round
    alone (a device's first) counts for 1 / (1 + prior) of itself and a record builds over rounds.
    """

    def __init__(self, rounds: int, prior: float) -> None:
        if rounds < 1 or prior < 0:
            raise ValueError(f"rounds must be >= 1 and prior >= 0, got {rounds} and {prior}")
        self.rounds, self.prior = rounds, prior
        self._deviations: dict[str, deque[float]] = {}

    def score(self, device: str, deviation: float | None = None) -> float:
        """The device's mean deviation (cosine minus its round's median), with this round's ``deviation`` when it
        counts and ``prior`` zeros; 0 for a device without a record."""
        past = self._deviations.get(device, ())
        total = sum(past) + (deviation or 0.0)
        return total / (len(past) + (deviation is not None) + self.prior or 1.0)

    def record(self, deviations: Mapping[str, float]) -> None:
        """One agreeing round's deviations (:func:`round_deviations`), each added to its device's record."""
        for device, value in deviations.items():
            self._deviations.setdefault(device, deque(maxlen=self.rounds)).append(float(value))

    def state(self) -> dict[str, list[float]]:
        """What a resumed run restores (:meth:`restore`)."""
        return {device: list(values) for device, values in self._deviations.items()}

    def restore(self, state: Mapping[str, Sequence[float]]) -> None:
        self._deviations = {d: deque(map(float, values), maxlen=self.rounds) for d, values in state.items()}


@dataclass(frozen=True)
class Removed:
    """An update the peer check takes out of its round: its cosine with the rest when it was, and why."""

    device: str
    cosine: float
    cut: float
    """The cosine cut of its round (:func:`peer_cut`) when it was taken out."""
    score: float | None = None
    """Its record (:meth:`PeerHistory.score`) when the record took it out, else None."""


def iterated_outliers(
    sketches: Mapping[str, Tensor],
    floor: float,
    spread: float,
    duplicate: float = DUPLICATE_COSINE,
    hard_floor: float | None = None,
    agreement: float | None = None,
    outlier: Outlier | None = None,
    history: PeerHistory | None = None,
    history_gap: float | None = None,
) -> list[Removed]:
    """The round's outliers taken out one at a time, worst first: after each, every cosine, the median and the
    spread are computed again without it, so an attacker's vote leaves the honest devices' references and the cut
    (Multi-Krum-style iterative removal). Never half the round or more.

    With ``history`` and ``history_gap``, an update is also an outlier when its device's record with this round
    (:meth:`PeerHistory.score`; this round counts only if it agrees) lies more than ``history_gap`` under the median.
    In a round that does not agree, the record judges only an update that lies under this round's median too: a
    device's past does not refuse an update that reads as usual now (a bad record then held an honest device out
    round after round, its update above the median, and the backoff compounded it).
    """
    remaining = dict(sketches)
    limit = (len(remaining) - 1) // 2
    removed: list[Removed] = []
    while len(removed) < limit:
        cosines = peer_cosines(remaining, duplicate)
        if len(cosines) < 3:
            break
        cut = peer_cut(cosines, floor, spread, hard_floor, agreement, outlier)
        margins = {device: cos - cut for device, cos in cosines.items()}
        scores: dict[str, float] = {}
        if history is not None and history_gap is not None:
            median = statistics.median(cosines.values())
            agrees = agreement is None or median >= agreement
            scores = {
                d: history.score(d, c - median if agrees else None) for d, c in cosines.items() if agrees or c < median
            }
            margins = {d: min(m, scores[d] + history_gap) if d in scores else m for d, m in margins.items()}
        worst = min(margins, key=margins.__getitem__)
        if margins[worst] >= 0:
            break
        by_record = cosines[worst] >= cut
        removed.append(Removed(worst, cosines[worst], cut, scores[worst] if by_record else None))
        del remaining[worst]
    return removed


def round_deviations(
    sketches: Mapping[str, Tensor],
    removed: Iterable[str],
    agreement: float | None,
    duplicate: float = DUPLICATE_COSINE,
) -> dict[str, float]:
    """What a round adds to :class:`PeerHistory`: per device, its cosine with the sum of the kept updates (its
    others, for a kept one) minus the kept updates' median, or nothing when the kept updates do not agree (their
    median under ``agreement``: a converged round on non-IID data says nothing about anyone)."""
    out = set(removed)
    kept = {d: s for d, s in sketches.items() if d not in out}
    cosines = peer_cosines(kept, duplicate)
    if len(cosines) < 3:
        return {}
    median = statistics.median(cosines.values())
    if agreement is not None and median < agreement:
        return {}
    reference = torch.stack([s / s.norm().clamp_min(1e-30) for s in kept.values()]).sum(dim=0)
    deviations = {d: c - median for d, c in cosines.items()}
    for device in out & set(sketches):
        scale = float(sketches[device].norm() * reference.norm())
        if scale > 0:
            deviations[device] = float(sketches[device] @ reference) / scale - median
    return deviations


@dataclass(frozen=True)
class Outlier:
    """In a round that agrees, how far under the round's median cosine an update may lie: ``deviations`` scaled
    median absolute deviations (a robust standard deviation), and never less than ``gap``, so a round whose updates
    all point nearly the same way does not refuse the least of them for a small difference."""

    deviations: float
    gap: float

    def cut(self, median: float, deviation: float) -> float:
        return median - max(self.deviations * deviation, self.gap)


def peer_cut(
    cosines: Mapping[str, float],
    floor: float,
    spread: float,
    hard_floor: float | None = None,
    agreement: float | None = None,
    outlier: Outlier | None = None,
) -> float:
    """The cosine below which an update is an outlier of its round.

    In a round whose updates agree (median cosine at least ``agreement``; None: every round): under ``floor``
    and also ``spread`` scaled median absolute deviations (a robust standard deviation) below the round's
    median; with ``outlier``, also under its cut whatever the floor says (:class:`Outlier`: far below the rest of
    an agreeing round, where a backdoor device's update lies on iid data). In every round: under ``hard_floor``,
    whatever the rest says. A round that does not agree has no direction to point against, so only the hard floor
    judges it (-inf without one: nothing refused).

    Early in training honest updates agree (median cosines 0.3-0.8, none of the soaks' honest updates below -0.02
    in such a round) and a reversed update sits far below the floor. Once a model on non-IID shards converges,
    each device pulls toward its own optimum, against the others' pull (at the fleet's optimum the pulls cancel),
    and with gradient noise the round's cosines spread around 0 or below: 20-minute soaks refused up to 34 honest
    updates at -0.10 to -0.30 with a floor or relative cut there. A reversal then reverses mostly noise.
    """
    values = list(cosines.values())
    median = statistics.median(values)
    lowest = -math.inf if hard_floor is None else hard_floor
    if agreement is not None and median < agreement:
        return lowest
    deviation = 1.4826 * statistics.median(abs(v - median) for v in values)
    cut = max(min(floor, median - spread * deviation), lowest)
    return cut if outlier is None else max(cut, outlier.cut(median, deviation))


def coordinate_median(updates: Sequence[Tensor]) -> Tensor:
    """Coordinate-wise median (Yin et al. 2018): every coordinate survives up to half the inputs bad."""
    return torch.stack(list(updates)).median(dim=0).values


def trimmed_mean(updates: Sequence[Tensor], beta: float) -> Tensor:
    """Coordinate-wise mean after dropping the ``beta`` fraction highest and lowest (Yin et al. 2018)."""
    if not 0 <= beta < 0.5:
        raise ValueError(f"trim fraction beta must be in [0, 0.5), got {beta}")
    stacked = torch.stack(list(updates)).sort(dim=0).values
    cut = math.floor(beta * len(updates))
    return stacked[cut : len(updates) - cut].mean(dim=0)


def multi_krum(updates: Sequence[Tensor], byzantine: int, keep: int) -> list[int]:
    """Indices of the ``keep`` updates with the lowest Krum score (Blanchard et al. 2017).

    A score is the sum of squared distances to the n - f - 2 nearest other updates, so an update
    far from the honest cluster scores high; it needs n > 2f + 2.
    """
    n = len(updates)
    if n <= 2 * byzantine + 2:
        raise ValueError(f"Krum needs more than 2f + 2 = {2 * byzantine + 2} updates, got {n}")
    flat = torch.stack([u.reshape(-1).to(torch.float64) for u in updates])
    distances = torch.cdist(flat, flat).square()
    nearest = n - byzantine - 2
    scores = [float(row[torch.arange(n) != i].sort().values[:nearest].sum()) for i, row in enumerate(distances)]
    return sorted(range(n), key=scores.__getitem__)[: max(1, keep)]


def buffered_aggregate(
    rule: str, uploads: Sequence[Mapping[str, Tensor]], weights: Sequence[float], trim: float, byzantine: int
) -> dict[str, Tensor]:
    """Per key, the round's uploads combined by ``rule`` (median, trimmed_mean or multi_krum), in float64.

    multi_krum averages, weighted, the n - f uploads Krum scores best; with too few uploads for
    Krum (n <= 2f + 2) it takes the coordinate median instead, so a round can always close.
    """
    keys = list(uploads[0])
    if rule == "multi_krum" and len(uploads) > 2 * byzantine + 2:
        flat = [torch.cat([u[k].reshape(-1).to(torch.float64) for k in keys]) for u in uploads]
        chosen = multi_krum(flat, byzantine, keep=len(uploads) - byzantine)
        total = sum(weights[i] for i in chosen)
        return {k: sum(uploads[i][k].to(torch.float64) * (weights[i] / total) for i in chosen) for k in keys}  # type: ignore[misc]
    if rule == "trimmed_mean":
        return {k: trimmed_mean([u[k].to(torch.float64) for u in uploads], trim) for k in keys}
    if rule in ("median", "multi_krum"):
        return {k: coordinate_median([u[k].to(torch.float64) for u in uploads]) for k in keys}
    raise ValueError(f"unknown robust rule {rule!r}; choose median, trimmed_mean or multi_krum")
