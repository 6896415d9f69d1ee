"""The upload gate's update bound: -9.5x the weights sent passes the old 10x bound, not this one."""

import pytest
import torch

from coordinator.config.limits import GateSettings
from coordinator.rounds.upload_gate import UploadGate, UploadRefused, squared_norms

SENT = {"w": torch.ones(100), "b": torch.zeros(10)}


def honest(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in SENT.items()}


def warmed_gate(settings: GateSettings) -> UploadGate:
    """A gate that has accepted three honest updates (layer update norms ~0.1 and ~0.03)."""
    gate = UploadGate(settings)
    for i in range(3):
        gate.sent(f"h{i}", squared_norms(SENT), SENT)
        gate.accepted(1.0, gate.norm(f"h{i}", 1.0, honest(i)))
    gate.sent("bad", squared_norms(SENT), SENT)
    return gate


def test_minus_nine_and_a_half_times_the_weights_is_clipped_to_one_and_a_half_times_the_median_update() -> None:
    gate = warmed_gate(GateSettings())
    median = gate.history.median("w")
    screened = gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()})
    assert screened.steps["w"] < 0.1  # its update of 10.5 x the weights kept only a fraction
    assert screened.update_norms["w"] == pytest.approx(1.5 * median, rel=1e-4)
    assert screened.upload["w"].shape == SENT["w"].shape
    assert "b" not in screened.steps  # -9.5 x zeros is no update at all
    assert gate.norm("bad", 1.0, honest(7)).steps == {}  # an honest update passes untouched


def test_with_refuse_the_same_upload_is_refused_naming_the_layer() -> None:
    gate = warmed_gate(GateSettings(update_bound_action="refuse"))
    with pytest.raises(UploadRefused, match="'w': update norm 105 is over its bound") as refused:
        gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()})
    assert refused.value.reason == "norm_too_large"


def test_before_any_median_the_update_may_move_as_far_as_the_weights_sent() -> None:
    gate = UploadGate(GateSettings())
    gate.sent("bad", squared_norms(SENT), SENT)
    screened = gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()})
    assert screened.update_norms["w"] == pytest.approx(float(SENT["w"].norm()), rel=1e-4)  # warm-up factor 1


def test_the_bound_can_be_turned_off_and_the_sample_weight_is_capped() -> None:
    gate = warmed_gate(GateSettings(update_bound_factor=None))
    assert gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()}).steps == {}
    assert gate.sample_weight(claimed=9_700, expected_samples=100) == 200
    assert gate.sample_weight(claimed=90, expected_samples=100) == 90
    assert UploadGate(GateSettings(sample_weight_factor=None)).sample_weight(9_700, 100) == 9_700
