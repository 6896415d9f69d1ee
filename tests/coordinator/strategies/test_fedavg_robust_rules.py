"""FedAvg's buffered robust rules: a far-off upload moves the mean, not the median, trimmed mean or multi-Krum."""

import pytest
import torch

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy

CNN = ModelSpec("cnn", 10, 1, 8)
SLOTS = [ClientSlot(f"c{i}", 1.0, 100) for i in range(7)]


def one_round(rule: str) -> dict[str, torch.Tensor]:
    """Six clients send the weights plus a small step, one sends -9.5x the weights; the new global state."""
    strategy = build_strategy("fedavg", CNN, {"rule": rule, "byzantine": 1, "trim": 0.2}, seed=0)  # trims 1 of 7
    sent = strategy.configure(1, SLOTS)
    round_ = strategy.open_round(1, SLOTS)
    for i, slot in enumerate(SLOTS):
        tensors = {k: v for k, v in sent[slot.client_id].tensors.items() if k in round_.sums}
        factor = -9.5 if i == 0 else 1.0 + 0.001 * i
        round_.add(slot.client_id, {k: v * factor for k, v in tensors.items()}, 100)
    before = strategy.global_state()
    strategy.close_round(round_)
    return {k: strategy.global_state()[k] / before[k] for k in round_.sums if before[k].abs().min() > 0}


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "multi_krum"])
def test_a_robust_rule_keeps_the_honest_step(rule: str) -> None:
    for ratio in one_round(rule).values():
        assert float(ratio.min()) >= 1.0 and float(ratio.max()) <= 1.006


def test_the_default_mean_is_dragged_by_the_one_bad_upload() -> None:
    assert all(float(ratio.max()) < 0 for ratio in one_round("mean").values())  # (6 x ~1 - 9.5) / 7 < 0


def test_an_unknown_rule_is_named() -> None:
    with pytest.raises(ValueError, match="rule"):
        build_strategy("fedavg", CNN, {"rule": "geomed"})
