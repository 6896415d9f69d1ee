"""Device-side clipping of the whole update, measured where the coordinator aggregates it."""

import math

import pytest
import torch

from device_agent.layers.factorized import factors_to_matrices
from device_agent.training.clipping import CannotClip, clip_update, update_norm


def dense(reduce, expand):
    a, b = factors_to_matrices(reduce.double(), expand.double())
    return a @ b


def sent_and_trained(scale):
    torch.manual_seed(0)
    sent = {
        "conv.reduce": torch.randn(3, 4, 1, 3),
        "conv.expand": torch.randn(5, 3, 3, 1),
        "fc.weight": torch.randn(10, 6),
        "fc.bias": torch.randn(10),
    }
    trained = {k: v + scale * torch.randn_like(v) for k, v in sent.items()}
    return sent, trained


def test_an_update_over_the_norm_is_scaled_onto_it_in_the_full_rank_space():
    sent, trained = sent_and_trained(1.0)
    norm = update_norm(sent, trained)
    clipped = clip_update(sent, trained, norm / 4)
    assert not clipped.unclipped and clipped.norm == pytest.approx(norm)
    # The factor pair goes up at twice the rank and multiplies out to AB + s (A'B' - AB), s = 1/4.
    assert clipped.upload["conv.reduce"].shape == (6, 4, 1, 3) and clipped.upload["conv.expand"].shape == (5, 6, 3, 1)
    before, after = (
        dense(sent["conv.reduce"], sent["conv.expand"]),
        dense(trained["conv.reduce"], trained["conv.expand"]),
    )
    got = dense(clipped.upload["conv.reduce"], clipped.upload["conv.expand"])
    torch.testing.assert_close(got, before + 0.25 * (after - before), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        clipped.upload["fc.bias"], sent["fc.bias"] + 0.25 * (trained["fc.bias"] - sent["fc.bias"])
    )
    # Measured as the coordinator does: the whole update now has the clip norm.
    moved = (got - before).square().sum() + sum(
        (clipped.upload[k].double() - sent[k].double()).square().sum() for k in ("fc.weight", "fc.bias")
    )
    assert math.sqrt(float(moved)) == pytest.approx(norm / 4, rel=1e-5)


def test_an_update_within_the_norm_goes_as_trained_and_says_so():
    sent, trained = sent_and_trained(1e-3)
    clipped = clip_update(sent, trained, 10.0)
    assert clipped.unclipped
    torch.testing.assert_close(clipped.upload["fc.weight"], trained["fc.weight"])
    got = dense(clipped.upload["conv.reduce"], clipped.upload["conv.expand"])
    torch.testing.assert_close(got, dense(trained["conv.reduce"], trained["conv.expand"]), rtol=1e-5, atol=1e-5)


def test_a_tensor_the_device_was_not_sent_cannot_be_clipped():
    sent, trained = sent_and_trained(1.0)
    with pytest.raises(CannotClip, match=r"'kept\.u'"):
        clip_update(sent, {**trained, "kept.u": torch.ones(3)}, 1.0)
