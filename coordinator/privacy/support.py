"""Which strategies DP-FedAvg applies to, and why not the others: fleet.yaml refuses ``privacy:`` with the reason.

It applies where the aggregate is a uniform average of one vector per device in one space every device shares, so
that one device moves the sum by at most its clip norm: FedAvg (the dense update) and FedHM (the dense update
A @ B - W of each layer, docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUPPORTED = frozenset({"fedavg", "fedhm"})

WHY_NOT: dict[str, str] = {
    "fedavg_small": "not yet: it trains one narrow model; DP is offered for fedavg",
    "heterofl": "not yet: each weight is averaged over the devices that hold it, so the noise would have to follow "
    "per-element counts (the sensitivity differs by width slice)",
    "fedrolex": "not yet: rolling width windows average each weight over a changing set of holders (as heterofl)",
    "factorized_fl": "not yet: it is personalized; the shared u vectors are mixed per device by similarity, not "
    "summed once, so no single noised sum covers a round",
    "factorized_fl_beta": "not yet: it is personalized (as factorized_fl)",
    "simfed": "not yet: it is personalized and its similarity weights read each device's raw embedding",
    "fedfac": "not yet: the server picks shared elements from the raw updates (a data-dependent choice DP must cover)",
    "fedlora": "not yet: heterogeneous LoRA ranks are averaged per rank slice (per-element counts, as heterofl)",
    "lora_homogeneous": "not yet: LoRA adapters are averaged as factors; DP would clip the product B @ A",
    "hetlora": "not yet: rank-weighted LoRA aggregation (per-element counts)",
    "flora": "not yet: stacked LoRA adapters grow with the participants",
    "ft": "not yet: full fine-tuning of the transformer is not wired to the privacy layer",
}


def privacy_problem(strategy: str, params: Mapping[str, Any]) -> str | None:
    """Why ``privacy:`` cannot be used with this strategy and these params (None: it can)."""
    if strategy not in SUPPORTED:
        why = WHY_NOT.get(strategy, "it does not declare a DP-ready aggregate")
        return f"strategy {strategy!r} cannot run with privacy: {why} (supported: {', '.join(sorted(SUPPORTED))})"
    if strategy == "fedhm":
        if params.get("weighting", "paper") != "uniform":
            return (
                "strategy.params.weighting: privacy averages devices uniformly (a rank- or sample-weighted sum has "
                "a larger sensitivity); write `weighting: uniform`"
            )
        if params.get("label_masked_classifier", "off") != "off":
            return (
                "strategy.params.label_masked_classifier: must be off with privacy (rows averaged over their holders)"
            )
        if params.get("global_as_pseudo_client", False):
            return "strategy.params.global_as_pseudo_client: must be false with privacy (it changes the average)"
    if strategy == "fedavg" and params.get("rule", "mean") != "mean":
        return (
            f"strategy.params.rule: {params.get('rule')!r} is not a sum, so one device's influence is not bounded by "
            "its clip norm; privacy needs rule: mean"
        )
    return None


__all__ = ["SUPPORTED", "WHY_NOT", "privacy_problem"]
