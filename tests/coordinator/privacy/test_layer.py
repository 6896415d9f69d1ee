"""The private round: one device moves the sum the noise is added to by at most its clip norm."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.privacy.layer import PrivateStrategy
from coordinator.privacy.settings import PrivacySettings
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients.base import is_norm_statistic
from device_agent.training.clipping import clip_update
from device_agent.training.local_round import UNCLIPPED

MODEL = ModelSpec("cnn", 10, 1, 8)
CASES = {"fedavg": ({}, [1.0, 1.0, 1.0]), "fedhm": ({"weighting": "uniform"}, [1.0, 0.5, 0.25])}


def private(name, clip=1.0):
    params, levels = CASES[name]
    settings = PrivacySettings(noise_multiplier=1.0, clip=clip)
    strategy = PrivateStrategy(build_strategy(name, MODEL, params, seed=0), settings, 1.0, len(levels))
    return strategy, [ClientSlot(f"d{i}", level, 10) for i, level in enumerate(levels)]


def trained_from(sent, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=generator)
        for k, v in sent.items()
        if v.is_floating_point() and not is_norm_statistic(k)
    }


def round_sum(strategy, slots, uploads):
    aggregate = strategy.open_round(1, slots)
    for slot in slots:
        aggregate.add(slot.client_id, uploads[slot.client_id], 10, {UNCLIPPED: torch.tensor([1])})
    return aggregate.sums


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=8)
@given(
    clip=st.floats(0.01, 10.0),
    scales=st.lists(st.floats(1e-4, 100.0), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_one_device_moves_the_noised_sum_by_at_most_the_clip_norm(name, clip, scales, seed):
    """With or without device d0's update (it uploads what it was sent), the sum where the noise is added moves by at
    most C in L2: the noise, drawn once for that sum, is the same either way. FedHM's devices sit at mixed levels."""
    strategy, slots = private(name, clip)
    sent = {c: a.tensors for c, a in strategy.configure(1, slots).items()}
    uploads = {
        slot.client_id: clip_update(sent[slot.client_id], trained_from(sent[slot.client_id], s, seed + i), clip).upload
        for i, (slot, s) in enumerate(zip(slots, scales, strict=True))
    }
    without = dict(uploads, d0=clip_update(sent["d0"], trained_from(sent["d0"], 0.0, 0), clip).upload)
    with_d0, without_d0 = round_sum(strategy, slots, uploads), round_sum(strategy, slots, without)
    moved = math.sqrt(sum(float((with_d0[k] - without_d0[k]).square().sum()) for k in with_d0))
    assert moved <= clip * (1 + 1e-5)


def test_an_upload_the_device_did_not_clip_is_refused():
    strategy, slots = private("fedhm", 0.5)
    sent = strategy.configure(1, slots)["d1"].tensors
    honest = clip_update(sent, trained_from(sent, 1.0, 1), 0.5).upload
    unclipped = clip_update(sent, trained_from(sent, 1.0, 1), 1e6).upload
    aggregate = strategy.open_round(1, slots)
    aggregate.check("d1", honest, 10, {UNCLIPPED: torch.tensor([0])})
    with pytest.raises(UpdateRejected, match="exceeds the clip norm") as refused:
        aggregate.check("d1", unclipped, 10, {UNCLIPPED: torch.tensor([1])})
    assert refused.value.reason == "over_clip_norm"
    contract = strategy.upload_contract(slots[1])  # clipped uploads carry factor pairs at twice the rank
    contract.check(honest)
    rank_r = {k: v for k, v in sent.items() if not is_norm_statistic(k)}
    with pytest.raises(UpdateRejected, match=r"reduce': shape .*expected") as refused:
        contract.check(rank_r)
    assert refused.value.reason == "bad_shape"


def test_the_ledger_and_the_adaptive_clip_norm_are_run_state():
    strategy, slots = private("fedavg", {"mode": "adaptive", "initial": 0.3})
    sent = {c: a.tensors for c, a in strategy.configure(1, slots).items()}
    aggregate = strategy.open_round(1, slots)
    for i, slot in enumerate(slots):
        clipped = clip_update(sent[slot.client_id], trained_from(sent[slot.client_id], 1.0, i), 0.3)
        aggregate.add(slot.client_id, clipped.upload, 10, {UNCLIPPED: torch.tensor([int(clipped.unclipped)])})
    before = {k: v.clone() for k, v in strategy.global_state().items()}
    strategy.close_round(aggregate)
    release = strategy.charge(30, 3)
    assert release.clip_norm != 0.3 and release.unclipped_fraction is not None and release.epsilon > 0
    after = strategy.global_state()
    assert all(
        not torch.equal(before[k], after[k]) for k in aggregate.sums
    )  # every uploaded tensor moved (and got noise)
    restored, _ = private("fedavg", {"mode": "adaptive", "initial": 0.3})
    restored.load_state_dict(strategy.state_dict())
    assert restored.clip_norm == strategy.clip_norm and restored.ledger.charges == strategy.ledger.charges
    assert restored.configure(2, slots)["d0"].spec.clip.norm == strategy.clip_norm
