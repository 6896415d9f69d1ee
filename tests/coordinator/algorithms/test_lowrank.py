import pytest
import torch

from coordinator.algorithms.lowrank import align, factorize
from device_agent.layers.factorized import weight_to_matrix
from device_agent.layers.hybrid import factorization_plan, hybrid

GAMMAS = (1.0, 0.5, 0.25, 0.125)


@pytest.fixture(scope="module")
def resnet18():
    torch.manual_seed(0)
    return hybrid("resnet18", 1.0).state_dict(), factorization_plan("resnet18")


@pytest.mark.slow
def test_every_level_loads_into_its_hybrid_model(resnet18):
    state, plan = resnet18
    levels = factorize(state, plan, GAMMAS)
    assert set(levels) == set(GAMMAS)
    for gamma, level in levels.items():
        hybrid("resnet18", gamma).load_state_dict(level, strict=True)
    assert levels[1.0] == state


@pytest.mark.slow
def test_each_level_is_the_optimal_truncation(resnet18):
    state, plan = resnet18
    levels = factorize(state, plan, GAMMAS[1:])
    for gamma in GAMMAS[1:]:
        rebuilt = align(levels[gamma], plan)
        for name in ("layer1.1.conv1", "layer3.0.conv1", "layer4.1.conv2"):
            weight = state[f"{name}.weight"].double()
            singular_values = torch.linalg.svdvals(weight_to_matrix(weight))
            optimal = float(singular_values[plan[name].rank(gamma) :].norm())
            error = float((rebuilt[f"{name}.weight"].double() - weight).norm())
            assert error == pytest.approx(optimal, rel=1e-4)


@pytest.mark.slow
def test_align_rebuilds_full_rank_keys_and_leaves_others(resnet18):
    state, plan = resnet18
    rebuilt = align(factorize(state, plan, [0.25])[0.25], plan)
    assert rebuilt.keys() == state.keys()
    assert all(rebuilt[k].shape == v.shape for k, v in state.items())
    torch.testing.assert_close(rebuilt["conv1.weight"], state["conv1.weight"])
    torch.testing.assert_close(rebuilt["layer4.1.bn2.bias"], state["layer4.1.bn2.bias"])
    assert align(state, plan) == state


def test_factorized_model_matches_the_aligned_dense_model():
    torch.manual_seed(1)
    plan = factorization_plan("cnn")
    dense = hybrid("cnn", 1.0).eval()
    low = hybrid("cnn", 0.5).eval()
    low.load_state_dict(factorize(dense.state_dict(), plan, [0.5])[0.5])
    dense.load_state_dict(align(low.state_dict(), plan))
    x = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(low(x), dense(x), rtol=1e-4, atol=1e-5)


def test_missing_full_rank_weight_is_named():
    plan = factorization_plan("cnn")
    state = hybrid("cnn", 1.0).state_dict()
    del state["conv2.weight"]
    with pytest.raises(KeyError, match=r"conv2\.weight"):
        factorize(state, plan, [0.5])
