"""FedHM aggregation (Eq. 2) as a streaming accumulator.

Every weighting is a per-client score normalized over the round's clients, so an update can be
folded in the moment it arrives and dropped: memory is one float64 copy of the model however
many clients report. Scores are kept in log space with a running maximum (log-sum-exp), so a
weighting that gives tiny weights (the reference's exp(-1/gamma) at small gamma) neither
underflows nor loses precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from enum import Enum

import torch
from torch import Tensor

from coordinator.algorithms.lowrank import factor_keys
from device_agent.layers.factorized import reconstruct
from device_agent.layers.hybrid import LayerSpec


class Weighting(str, Enum):
    """How clients of different rank ratios are weighted in the average."""

    PAPER = "paper"
    """FedHM paper Eq. 2: alpha_p = softmax(gamma_p / tau). The default."""
    REFERENCE = "reference"
    """CGCL-codes/FedHM code: softmax(-(1 / gamma_p) / tau); favours full-rank clients strongly."""
    SAMPLES = "samples"
    """FedAvg: proportional to the client's number of training samples."""
    UNIFORM = "uniform"
    """Every client counts the same."""


class ClassifierRule(str, Enum):
    """How the classifier rows of clients at gamma < 1 are averaged (FedHM's label-masked classifier).

    Full-rank clients count for every row under every rule, as in the reference code.
    """

    OFF = "off"
    """Every client's rows count for every class: the plain Eq. 2 average."""
    REFERENCE = "reference"
    """CGCL-codes/FedHM: a gamma < 1 client adds alpha_p * W_p[c] only for the classes c it holds,
    with alpha_p normalized over all of the round's clients and not renormalised per row, so a row
    held by few clients shrinks. The reference starts from zeros, so a row no client contributed to
    becomes zero; here it keeps the previous global row instead (an element nobody trained keeps
    its value, as everywhere else in the aggregator)."""
    RENORMALISED = "renormalised"
    """As ``reference``, but each row divides by the weights of the clients that contributed to it."""


class UpdateRejected(ValueError):
    """A client update that cannot be aggregated; the message names the offending key.

    ``reason`` is a short snake_case code the engine counts refusals by (``coordinator.rounds.upload_gate.REASONS``).
    """

    def __init__(self, message: str, reason: str = "rejected") -> None:
        super().__init__(message)
        self.reason = reason


MAX_ABS_VALUE = 1e6
"""Largest magnitude an uploaded value may have. Trained weights, factors and BN statistics stay
orders of magnitude below; a finite 3e38 would still overflow every sum it is folded into."""


def check_values(key: str, value: Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Of ``dtype`` (the model's), finite and bounded; else ``UpdateRejected`` naming ``key``.

    The dtype comes first: float8 has no ``isfinite``, and a float64 or bfloat16 tensor is not what any client sends.
    """
    if value.dtype != dtype:
        raise UpdateRejected(f"{key!r}: dtype {value.dtype}, expected {dtype}", "bad_dtype")
    if value.numel() == 0:
        return
    largest = float(value.abs().amax())  # one pass: the largest magnitude is NaN or inf when any value is
    if not math.isfinite(largest):
        raise UpdateRejected(f"{key!r}: contains NaN or infinite values", "non_finite")
    if largest > MAX_ABS_VALUE:
        raise UpdateRejected(
            f"{key!r}: a value of magnitude {largest:.3g} exceeds the bound {MAX_ABS_VALUE:g}", "out_of_bounds"
        )


def parse_classes(extras: Mapping[str, Tensor] | None, num_classes: int) -> Tensor:
    """Boolean row mask of the classes a client reports in ``extras['classes']``; ``UpdateRejected`` if malformed.

    A client may only name classes of the model, each once: the list is bounded by ``num_classes``.
    """
    classes = (extras or {}).get("classes")
    if classes is None:
        raise UpdateRejected(
            "'classes': label-masked aggregation needs the client's classes in its extras", "missing_tensor"
        )
    if not isinstance(classes, Tensor) or classes.dtype not in (torch.int32, torch.int64) or classes.dim() != 1:
        raise UpdateRejected("'classes': expected a 1-D integer tensor of class indices", "bad_dtype")
    if len(classes) > num_classes:
        raise UpdateRejected(f"'classes': {len(classes)} entries for a model of {num_classes} classes", "out_of_bounds")
    if len(classes) and (int(classes.min()) < 0 or int(classes.max()) >= num_classes):
        raise UpdateRejected(f"'classes': indices must lie in [0, {num_classes})", "out_of_bounds")
    if len(classes.unique()) != len(classes):
        raise UpdateRejected("'classes': a class index is listed twice", "out_of_bounds")
    rows = torch.zeros(num_classes, dtype=torch.bool)
    rows[classes] = True
    return rows


def parse_classifier_rule(value: ClassifierRule | str) -> ClassifierRule:
    try:
        return ClassifierRule(value)
    except ValueError:
        choices = ", ".join(r.value for r in ClassifierRule)
        raise ValueError(f"unknown label_masked_classifier {value!r}; choose one of: {choices}") from None


def parse_weighting(value: Weighting | str) -> Weighting:
    try:
        return Weighting(value)
    except ValueError:
        choices = ", ".join(w.value for w in Weighting)
        raise ValueError(f"unknown weighting {value!r}; choose one of: {choices}") from None


def log_score(weighting: Weighting | str, gamma: float, num_samples: int, temperature: float = 1.0) -> float:
    """Unnormalized log-weight of one client; softmax over the round's clients gives alpha."""
    weighting = parse_weighting(weighting)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < gamma <= 1:
        raise ValueError(f"rank ratio gamma must be in (0, 1], got {gamma}")
    if weighting is Weighting.PAPER:
        return gamma / temperature
    if weighting is Weighting.REFERENCE:
        return -(1.0 / gamma) / temperature
    if weighting is Weighting.SAMPLES:
        if num_samples <= 0:
            raise ValueError(f"sample-count weighting needs num_samples > 0, got {num_samples}")
        return math.log(num_samples)
    return 0.0


def aggregation_weights(
    weighting: Weighting | str,
    gammas: Sequence[float],
    num_samples: Sequence[int] | None = None,
    temperature: float = 1.0,
) -> list[float]:
    """Normalized alpha_p for a round's clients (for logs, reports and tests)."""
    samples = num_samples if num_samples is not None else [1] * len(gammas)
    scores = [log_score(weighting, g, n, temperature) for g, n in zip(gammas, samples, strict=True)]
    top = max(scores)
    exp = [math.exp(s - top) for s in scores]
    total = sum(exp)
    return [e / total for e in exp]


class StreamingAggregator:
    """Weighted average of client updates into full-rank weights, one update at a time.

    ``global_state`` is the current full-rank model: it fixes the keys and shapes updates must
    match, and any key no client sent (e.g. BatchNorm statistics kept local) keeps its value.
    Integer buffers are never averaged. Updates may hold a layer as factors
    (``<layer>.reduce`` / ``<layer>.expand``, at the rank the client's gamma implies) or dense.

    ``global_as_pseudo_client`` adds the previous global model as one more client with gamma = 1
    when no full-rank client took part, as the reference code does (off by default).

    ``classifier_keys`` (the last linear layer's weight and bias) are averaged row by row under
    ``classifier_rule`` (:class:`ClassifierRule`); a gamma < 1 client then passes the boolean row
    mask of its classes to :meth:`add`.
    """

    def __init__(
        self,
        global_state: Mapping[str, Tensor],
        plan: Mapping[str, LayerSpec],
        weighting: Weighting | str = Weighting.PAPER,
        temperature: float = 1.0,
        global_as_pseudo_client: bool = False,
        classifier_rule: ClassifierRule | str = ClassifierRule.OFF,
        classifier_keys: frozenset[str] = frozenset(),
    ) -> None:
        self.global_state = dict(global_state)
        self.classifier_rule = parse_classifier_rule(classifier_rule)
        self.classifier_keys = classifier_keys if self.classifier_rule is not ClassifierRule.OFF else frozenset()
        self._row_totals: dict[str, Tensor] = {}
        self._weight_total = 0.0
        self.plan = dict(plan)
        self.weighting = parse_weighting(weighting)
        self.temperature = temperature
        self.global_as_pseudo_client = global_as_pseudo_client
        self._sums: dict[str, Tensor] = {}
        self._totals: dict[str, float] = {}
        self._shift = -math.inf
        self._sample_total = 0
        self.num_clients = 0
        self.saw_full_rank = False
        self._layer_of = {key: name for name in self.plan for key in factor_keys(name)}

    def check(self, update: Mapping[str, Tensor], gamma: float) -> None:
        """Raise ``UpdateRejected`` if :meth:`add` would refuse ``update``; changes nothing."""
        self._validated(update, gamma)

    def add(self, update: Mapping[str, Tensor], gamma: float, num_samples: int = 1, rows: Tensor | None = None) -> None:
        """Validate the whole update, then fold it in; a rejected update changes nothing.

        ``rows`` (a boolean mask over classes, from :func:`parse_classes`) limits a gamma < 1
        client's classifier rows under a label-masked rule; full-rank clients count for every row.
        """
        score = log_score(self.weighting, gamma, num_samples, self.temperature)
        dense = self._validated(update, gamma)
        if self.classifier_keys and gamma < 1 and rows is None:
            raise UpdateRejected("'classes': label-masked aggregation needs the client's classes", "missing_tensor")
        for key in self.classifier_keys:
            if rows is not None and len(rows) != self.global_state[key].shape[0]:
                raise UpdateRejected(f"'classes': a mask over {len(rows)} classes for {key!r}", "bad_shape")
        self._fold(dense, score, rows if gamma < 1 else None)
        self.num_clients += 1
        self._sample_total += num_samples
        self.saw_full_rank |= gamma == 1

    def result(self) -> dict[str, Tensor]:
        """The aggregated full-rank state (the global state where no client contributed)."""
        if self.global_as_pseudo_client and self.num_clients and not self.saw_full_rank:
            samples = max(1, round(self._sample_total / self.num_clients))
            score = log_score(self.weighting, 1.0, samples, self.temperature)
            floats = {k: v for k, v in self.global_state.items() if v.is_floating_point()}
            self._fold({k: (lambda v=v: v.to(torch.float64)) for k, v in floats.items()}, score)
            self.saw_full_rank = True
        out = dict(self.global_state)
        for key, total in self._sums.items():
            if key in self._row_totals:
                out[key] = self._masked_rows(key, total)
            else:
                out[key] = (total / self._totals[key]).to(self.global_state[key].dtype)
        return out

    def _masked_rows(self, key: str, total: Tensor) -> Tensor:
        """Classifier rows under the label-masked rule; a row nobody contributed to keeps its global value."""
        row_totals = self._row_totals[key]
        held = row_totals > 0
        shape = (-1,) + (1,) * (total.dim() - 1)
        if self.classifier_rule is ClassifierRule.REFERENCE:
            divisor = torch.full_like(row_totals, self._weight_total)
        else:
            divisor = torch.where(held, row_totals, torch.ones_like(row_totals))
        previous = self.global_state[key]
        rows = total / divisor.view(shape)
        return torch.where(held.view(shape), rows, previous.to(torch.float64)).to(previous.dtype)

    def _validated(self, update: Mapping[str, Tensor], gamma: float) -> dict[str, Callable[[], Tensor]]:
        """Key -> callable producing the dense float64 tensor: lazy, so folding holds one layer at a time."""
        dense: dict[str, Callable[[], Tensor]] = {}
        seen_factors: set[str] = set()
        for key, value in update.items():
            if not isinstance(value, Tensor):
                raise UpdateRejected(f"{key!r}: expected a tensor, got {type(value).__name__}")
            layer = self._layer_of.get(key)
            expected = self.global_state.get(key)
            if layer is None and expected is None:
                raise UpdateRejected(f"{key!r}: not a parameter of this model", "unknown_tensor")
            if expected is not None and not expected.is_floating_point():
                continue
            if not value.is_floating_point():
                raise UpdateRejected(f"{key!r}: expected a floating-point tensor, got {value.dtype}", "bad_dtype")
            check_values(key, value, torch.float32 if expected is None else expected.dtype)
            if layer is not None:
                seen_factors.add(layer)
                continue
            if gamma < 1 and key.endswith(".weight") and key[: -len(".weight")] in self.plan:
                raise UpdateRejected(f"{key!r}: a client at gamma={gamma} must send this layer as factors")
            if value.shape != expected.shape:
                raise UpdateRejected(
                    f"{key!r}: shape {tuple(value.shape)}, expected {tuple(expected.shape)}", "bad_shape"
                )
            dense[key] = lambda v=value: v.to(torch.float64)
        for layer in seen_factors:
            spec = self.plan[layer]
            reduce_key, expand_key = factor_keys(layer)
            if reduce_key not in update or expand_key not in update:
                raise UpdateRejected(f"{layer!r}: got only one of {reduce_key!r} / {expand_key!r}", "missing_tensor")
            if f"{layer}.weight" in update:
                raise UpdateRejected(f"{layer!r}: sent both factors and a dense weight")
            want_reduce, want_expand = spec.factor_shapes(gamma)
            for key, want in ((reduce_key, want_reduce), (expand_key, want_expand)):
                if tuple(update[key].shape) != want:
                    raise UpdateRejected(
                        f"{key!r}: shape {tuple(update[key].shape)}, expected {want} for gamma={gamma}", "bad_shape"
                    )
            reduce, expand = update[reduce_key], update[expand_key]
            dense[f"{layer}.weight"] = lambda r=reduce, e=expand, s=spec.shape: reconstruct(
                r.to(torch.float64), e.to(torch.float64), s
            )
        if not dense:
            raise UpdateRejected("update holds no parameters of this model")
        return dense

    def _fold(self, dense: Mapping[str, Callable[[], Tensor]], score: float, rows: Tensor | None = None) -> None:
        if score > self._shift:
            rescale = math.exp(self._shift - score) if self._shift > -math.inf else 0.0
            for key in self._sums:
                self._sums[key].mul_(rescale)
                self._totals[key] *= rescale
            for totals in self._row_totals.values():
                totals.mul_(rescale)
            self._weight_total *= rescale
            self._shift = score
        weight = math.exp(score - self._shift)
        self._weight_total += weight
        for key, make in dense.items():
            tensor = make()
            if key in self.classifier_keys:
                mask = torch.ones(tensor.shape[0], dtype=torch.float64) if rows is None else rows.to(torch.float64)
                tensor = tensor * mask.view((-1,) + (1,) * (tensor.dim() - 1))
                self._row_totals.setdefault(key, torch.zeros_like(mask)).add_(mask, alpha=weight)
            if key in self._sums:
                self._sums[key].add_(tensor, alpha=weight)
                self._totals[key] += weight
            else:
                self._sums[key] = tensor * weight
                self._totals[key] = weight
