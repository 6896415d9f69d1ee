"""fleet.yaml ``strategy.mode: async``: FedBuff's buffered asynchronous aggregation, and where it cannot run.

In async mode there are no rounds: every device trains on the newest model it was sent, the coordinator folds
each arriving update with a weight that shrinks with its staleness (how many models were published since the
one it trained on) and publishes a new model version every ``buffer`` updates (Nguyen et al., FedBuff, 2022).
docs/async.md explains each setting; :func:`async_problem` says which strategies can run so and why not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

SUPPORTED = frozenset({"fedavg", "fedhm"})
"""Strategies whose update is one dense delta in the global model's space (FedHM: each layer's A @ B rebuilt)."""

WHY_NOT: dict[str, str] = {
    "fedavg_small": "not yet: its width is fixed by the first round's smallest device; async is offered for fedavg",
    "heterofl": "each weight is averaged over the devices that hold it this round; a buffer mixes updates of "
    "different versions, whose per-element holder counts do not add up",
    "fedrolex": "its width window rolls with the round number, which async has no notion of",
    "factorized_fl": "it is personalized: each device's u vectors are mixed by similarity over one round's uploads",
    "factorized_fl_beta": "it is personalized (as factorized_fl)",
    "simfed": "it is personalized: similarity weights compare one round's devices with each other",
    "fedfac": "the server picks shared elements from all of one round's updates at once",
    "fedlora": "heterogeneous LoRA ranks are averaged per rank slice over one round's holders",
    "lora_homogeneous": "LoRA adapters are averaged as factors; a stale B and A do not combine as a delta",
    "hetlora": "rank-weighted LoRA aggregation over one round's uploads",
    "flora": "stacked LoRA adapters grow with one round's participants",
    "ft": "not wired: full fine-tuning of the transformer keeps no delta space of its own",
}


class StalenessWeight(BaseModel):
    """How much an update trained ``s`` versions ago counts: ``constant`` 1, or ``polynomial`` 1 / (1 + s)^exponent
    (FedBuff's default: exponent 0.5, 1 / sqrt(1 + s))."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rule: Literal["polynomial", "constant"] = Field("polynomial", description="polynomial: 1/(1+s)^exponent")
    exponent: float = Field(0.5, ge=0, le=8, description="polynomial's exponent a (0 is constant)")

    def __call__(self, staleness: int) -> float:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        return 1.0 if self.rule == "constant" else (1.0 + staleness) ** -self.exponent


class AsyncSettings(BaseModel):
    """``strategy.async``: FedBuff's buffer, server learning rate and bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    buffer: PositiveInt = Field(10, description="K: a new model version is published every K folded updates")
    server_lr: PositiveFloat = Field(1.0, le=10, description="eta_g: the step along the buffer's mean update")
    max_staleness: int = Field(
        20, ge=0, description="an update trained on a model more than this many versions old is refused (too_stale)"
    )
    concurrency: PositiveInt | None = Field(
        None, description="at most this many devices train at once (null: every online device)"
    )
    staleness_weight: StalenessWeight = Field(StalenessWeight(), description="how staleness discounts an update")


def async_problem(strategy: str, params: Mapping[str, Any], privacy: bool, secure: bool) -> str | None:
    """Why ``strategy.mode: async`` cannot run with this strategy and fleet (None: it can), naming the key."""
    if strategy not in SUPPORTED:
        why = WHY_NOT.get(strategy, "it does not declare a dense update space")
        return f"strategy.mode: {strategy!r} cannot run async: {why} (async runs: {', '.join(sorted(SUPPORTED))})"
    if strategy == "fedhm" and params.get("global_as_pseudo_client", False):
        return "strategy.params.global_as_pseudo_client: must be false in async mode (one update is folded at a time)"
    if strategy == "fedavg" and params.get("rule", "mean") != "mean":
        return f"strategy.params.rule: {params.get('rule')!r} needs a whole round's uploads at once; async needs mean"
    if secure:
        return (
            "secure_aggregation: not with strategy.mode async: SecAgg+ unmasks the sum of one round's devices, and "
            "async folds each update on its own (remove secure_aggregation or use mode: sync)"
        )
    if privacy:
        return "privacy: not with strategy.mode async yet: the accountant charges rounds, and async has none"
    return None


__all__ = ["SUPPORTED", "WHY_NOT", "AsyncSettings", "StalenessWeight", "async_problem"]
