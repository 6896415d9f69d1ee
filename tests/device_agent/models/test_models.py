import pytest
import torch

from device_agent.layers.factorized import FactorizedConv2d, reconstruct, spectral_factors, weight_to_matrix
from device_agent.layers.hybrid import factorization_plan, hybrid
from device_agent.models import MODELS, build_model


def trainable_params(name: str, gamma: float, num_classes: int) -> int:
    with torch.device("meta"):
        model = hybrid(name, gamma, num_classes)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("name", "num_classes", "gamma", "paper_millions"),
    [
        ("resnet18", 10, 1, 11.17),
        ("resnet18", 10, 1 / 2, 4.16),
        ("resnet18", 10, 1 / 4, 2.21),
        ("resnet18", 10, 1 / 8, 1.24),
        ("resnet34", 100, 1, 21.33),
        ("resnet34", 100, 1 / 2, 8.40),
        ("resnet34", 100, 1 / 4, 4.99),
        ("resnet34", 100, 1 / 8, 3.27),
        ("resnet9", 10, 1, 2.57),
    ],
)
def test_parameter_counts_match_the_papers(name, num_classes, gamma, paper_millions):
    """FedHM Table 2 (ResNet-18/34) and Factorized-FL Sec. C.1 (ResNet-9), within 0.5%."""
    assert trainable_params(name, gamma, num_classes) / 1e6 == pytest.approx(paper_millions, rel=0.005)


@pytest.mark.parametrize(
    ("name", "in_channels", "size"),
    [("cnn", 1, 8), ("cnn", 3, 16), ("cnn", 3, 32), ("resnet18", 1, 8), ("resnet9", 3, 16), ("resnet34", 3, 8)],
)
def test_models_take_any_channels_size_and_classes(name, in_channels, size):
    model = build_model(name, num_classes=7, in_channels=in_channels).eval()
    assert model(torch.randn(2, in_channels, size, size)).shape == (2, 7)


# The ImageNet-sized ones take seconds each: left to the full suite.
BIG_MODELS = {"resnet18", "resnet34", "vit_small"}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in BIG_MODELS else name for name in sorted(MODELS)]
)
def test_hybrid_models_run_and_shrink(name):
    model = hybrid(name, 0.25, num_classes=5).eval()
    size = MODELS[name].image_size
    assert model(torch.randn(2, MODELS[name].in_channels, size, size)).shape == (2, 5)
    assert trainable_params(name, 0.25, 5) < trainable_params(name, 1, 5)


def test_resnet18_keeps_the_reference_full_rank_set():
    plan = factorization_plan("resnet18")
    assert "conv1" not in plan and "fc" not in plan
    assert not any(name.startswith("layer1.0.") or ".downsample." in name for name in plan)
    assert {"layer1.1.conv1", "layer2.0.conv1", "layer4.1.conv2"} <= set(plan)
    assert len(plan) == 14


def test_resnet34_factorizes_layers_3_and_4_only():
    plan = factorization_plan("resnet34", num_classes=100)
    assert {name.split(".")[0] for name in plan} == {"layer3", "layer4"}
    assert len(plan) == 2 * (6 + 3) - 0


def test_hybrid_is_the_spectral_projection_of_the_plain_model_under_one_seed():
    torch.manual_seed(7)
    plain = build_model("cnn")
    torch.manual_seed(7)
    low = hybrid("cnn", 0.5)
    layer = low.conv3
    assert isinstance(layer, FactorizedConv2d) and layer.rank == 64
    a, b = spectral_factors(weight_to_matrix(plain.conv3.weight.detach()), layer.rank)
    expected = (a @ b).reshape(128, 3, 64, 3).permute(0, 2, 1, 3)
    torch.testing.assert_close(reconstruct(layer.reduce, layer.expand, layer.weight_shape), expected)
    torch.testing.assert_close(low.conv1.weight, plain.conv1.weight)


def test_full_rank_set_can_be_overridden():
    assert "conv1" in factorization_plan("cnn", full_rank=("fc",))
    model = hybrid("cnn", 0.5, full_rank=("fc",))
    assert isinstance(model.conv1, FactorizedConv2d)


def test_unknown_model_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown model 'resnet50'.*resnet18"):
        build_model("resnet50")


def test_gamma_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="gamma"):
        hybrid("cnn", 0)


def test_vit_fmnist_is_a_1_2_m_vit_for_28x28_whose_head_reads_its_features():
    model = build_model("vit_fmnist", num_classes=10, in_channels=1).eval()
    x = torch.randn(2, 1, 28, 28)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(1.2, abs=0.05)
    assert model.features(x).shape == (2, 128)
    torch.testing.assert_close(model(x), model.head(model.features(x)))
