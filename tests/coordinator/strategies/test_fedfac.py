import pytest
import torch
from safetensors.torch import load, save

from coordinator.strategies import ClientSlot, build_strategy
from tests.coordinator.strategies.personal_helpers import CNN, run_round, slots


def fake_uploads(strategy, ids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        c: {
            k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
            for k, v in strategy.global_weights.items()
        }
        for c in ids
    }


def close(strategy, uploads, samples):
    aggregate = strategy.open_round(0, [ClientSlot(c, 1.0, samples[c]) for c in uploads])
    for c in uploads:
        aggregate.add(c, uploads[c], samples[c])
    strategy.close_round(aggregate)


def test_default_split_layer_is_the_one_before_the_classifier_with_its_norm_private():
    strategy = build_strategy("fedfac", CNN)
    assert strategy.layers == ("conv3",)
    assert set(strategy.private_keys) == {
        "bn3.weight",
        "bn3.bias",
        "bn3.running_mean",
        "bn3.running_var",
        "bn3.num_batches_tracked",
    }


def test_shared_elements_are_averaged_and_personal_ones_kept_per_client():
    strategy = build_strategy("fedfac", CNN, {"tau_quantile": 0.5})
    ids = ["a", "b", "c"]
    uploads = fake_uploads(strategy, ids)
    close(strategy, uploads, {"a": 10, "b": 20, "c": 10})
    shared = strategy.split["conv3"]
    assert 0 < int(shared.sum()) < len(shared)
    mean = (uploads["a"]["conv3.weight"] + 2 * uploads["b"]["conv3.weight"] + uploads["c"]["conv3.weight"]) / 4
    got = strategy.configure(1, [ClientSlot("b", 1.0, 20)])["b"].tensors
    torch.testing.assert_close(got["conv3.weight"][shared], mean[shared])
    torch.testing.assert_close(got["conv3.weight"][~shared], uploads["b"]["conv3.weight"][~shared])
    torch.testing.assert_close(got["bn3.weight"], uploads["b"]["bn3.weight"])
    mean_conv2 = (uploads["a"]["conv2.weight"] + 2 * uploads["b"]["conv2.weight"] + uploads["c"]["conv2.weight"]) / 4
    torch.testing.assert_close(got["conv2.weight"], mean_conv2)


def test_inf_threshold_keeps_every_element_personal():
    strategy = build_strategy("fedfac", CNN, {"tau_quantile": "inf"})
    uploads = fake_uploads(strategy, ["a", "b"])
    close(strategy, uploads, {"a": 5, "b": 5})
    got = strategy.configure(1, [ClientSlot("a", 1.0, 5)])["a"].tensors
    assert torch.equal(got["conv3.weight"], uploads["a"]["conv3.weight"])


def test_static_splits_once_dynamic_every_round():
    static = build_strategy("fedfac", CNN, {"mode": "static"})
    dynamic = build_strategy("fedfac", CNN, {"mode": "dynamic"})
    for seed in range(2):
        for strategy in (static, dynamic):
            close(strategy, fake_uploads(strategy, ["a", "b", "c"], seed), {"a": 1, "b": 1, "c": 1})
        if seed == 0:
            first_static, first_dynamic = static.split["conv3"].clone(), dynamic.split["conv3"].clone()
    assert torch.equal(static.split["conv3"], first_static)
    assert not torch.equal(dynamic.split["conv3"], first_dynamic)


def test_result_is_independent_of_client_order():
    ids = ["p", "q", "r"]
    states = []
    for order in (ids, ids[::-1], ids[1:] + ids[:1]):
        strategy = build_strategy("fedfac", CNN)
        uploads = fake_uploads(strategy, ids)
        close(strategy, {c: uploads[c] for c in order}, {"p": 3, "q": 5, "r": 7})
        states.append(strategy.state_dict())
    for other in states[1:]:
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])


def test_trains_end_to_end_and_round_trips_its_state():
    strategy = build_strategy("fedfac", CNN, {"layers": ["conv2", "conv3"]}, seed=1)
    run_round(strategy, 0, slots(3), {})
    restored = build_strategy("fedfac", CNN, {"layers": ["conv2", "conv3"]}, seed=5)
    restored.load_state_dict(load(save(strategy.state_dict())))
    a = strategy.configure(1, slots(3))
    b = restored.configure(1, slots(3))
    for client in a:
        assert all(torch.equal(a[client].tensors[k], b[client].tensors[k]) for k in a[client].tensors)


def test_unknown_layer_and_bad_quantile_are_named():
    with pytest.raises(ValueError, match="'conv9'"):
        build_strategy("fedfac", CNN, {"layers": ["conv9"]})
    with pytest.raises(ValueError, match="tau_quantile"):
        build_strategy("fedfac", CNN, {"tau_quantile": 1.5})
