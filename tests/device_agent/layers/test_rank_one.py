import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_agent.layers import RankOneLayer, l1_on_mu, rank_one_layers, reparametrize, similarity_layer
from device_agent.layers.rank_one import to_matrix
from device_agent.models import build_model


def test_kernel_layout_u_indexes_kernel_positions():
    layer = RankOneLayer((2, 3, 2, 2), layout="kernel")
    with torch.no_grad():
        layer.u.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        layer.v.copy_(torch.arange(1.0, 7.0))
    weight = layer.weight()
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    for o in range(2):
        for i in range(3):
            torch.testing.assert_close(weight[o, i], base * (o * 3 + i + 1))


def test_kernel_layout_is_not_the_reference_view():
    """The reference's .view of the (F*F, O*I) matrix would scale contiguous slices instead."""
    layer = RankOneLayer((4, 4, 3, 3), layout="kernel")
    with torch.no_grad():
        layer.u.copy_(torch.arange(1.0, 10.0))
        layer.v.fill_(1.0)
    naive = torch.outer(layer.u, layer.v).view(4, 4, 3, 3)
    ours = layer.weight()
    assert not torch.equal(naive, ours)
    assert all(torch.equal(ours[o, i], layer.u.reshape(3, 3)) for o in range(4) for i in range(4))


def test_channel_layout_u_indexes_input_channel_and_column():
    layer = RankOneLayer((2, 3, 2, 2), layout="channel")
    with torch.no_grad():
        layer.u.copy_(torch.arange(1.0, 7.0))  # (i, c) -> i*2 + c
        layer.v.copy_(torch.arange(10.0, 14.0))  # (o, r) -> o*2 + r
        layer.mu[5, 2] = 0.5  # (i=2, c=1), (o=1, r=0)
    weight = layer.weight().detach()
    u, v = layer.u.detach(), layer.v.detach()
    for o in range(2):
        for i in range(3):
            for r in range(2):
                for c in range(2):
                    expected = u[i * 2 + c] * v[o * 2 + r] + (0.5 if (o, i, r, c) == (1, 2, 0, 1) else 0)
                    assert float(weight[o, i, r, c]) == pytest.approx(float(expected))


@pytest.mark.parametrize("layout", ["kernel", "channel"])
def test_conv_forward_is_dense_conv_of_its_weight(layout):
    torch.manual_seed(0)
    layer = RankOneLayer((5, 3, 3, 3), layout=layout, stride=2, padding=1, bias=True).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.conv2d(x, layer.weight(), layer.bias, stride=2, padding=1))


@pytest.mark.parametrize("layout", ["kernel", "channel"])
def test_reparametrize_starts_from_the_best_rank_one_part_with_zero_mu(layout):
    torch.manual_seed(1)
    dense = nn.Conv2d(4, 6, 3, padding=1, bias=False)
    layer = RankOneLayer((6, 4, 3, 3), layout=layout, padding=1)
    layer.load_dense_(dense.weight)
    assert torch.count_nonzero(layer.mu) == 0

    sigma = torch.linalg.svdvals(to_matrix(dense.weight.detach().double(), layout))
    error = torch.linalg.norm(to_matrix(layer.weight().detach().double() - dense.weight.detach().double(), layout))
    assert float(error) == pytest.approx(float(sigma[1:].square().sum().sqrt()), rel=1e-4)


@pytest.mark.parametrize("arch", ["cnn", "resnet9"])
def test_reparametrize_replaces_every_conv_and_linear(arch):
    model = reparametrize(build_model(arch, num_classes=10), layout="kernel")
    assert not any(isinstance(m, nn.Conv2d | nn.Linear) for m in model.modules())
    layers = rank_one_layers(model)
    assert list(layers)[-1] == "fc"
    card_size = 8 if arch == "cnn" else 32
    x = torch.randn(2, 1 if arch == "cnn" else 3, card_size, card_size)
    assert model(x).shape == (2, 10)
    assert similarity_layer(model) == ("conv3" if arch == "cnn" else "conv8.conv")


def test_keep_dense_leaves_matching_layers_alone():
    model = reparametrize(build_model("cnn"), keep_dense=("fc",))
    assert isinstance(model.fc, nn.Linear)
    assert "fc" not in rank_one_layers(model)


def test_l1_term_has_a_nonzero_gradient_on_mu():
    torch.manual_seed(0)
    model = reparametrize(build_model("cnn"))
    with torch.no_grad():
        for layer in rank_one_layers(model).values():
            layer.mu.normal_(std=1e-3)
    l1_on_mu(model).backward()
    for name, layer in rank_one_layers(model).items():
        assert layer.mu.grad is not None, name
        torch.testing.assert_close(layer.mu.grad, torch.sign(layer.mu.detach()))


def test_pruning_applies_in_evaluation_only():
    layer = RankOneLayer((2, 3), prune_below=0.1)
    with torch.no_grad():
        layer.mu.copy_(torch.tensor([[0.05, 0.2], [-0.3, -0.01], [0.0, 0.1]]))
    assert torch.count_nonzero(layer.weight()) == 5
    layer.eval()
    assert torch.count_nonzero(layer.weight()) == 3


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="square kernels"):
        RankOneLayer((2, 2, 3, 1))
    with pytest.raises(ValueError, match="layout"):
        RankOneLayer((2, 2), layout="rows")  # type: ignore[arg-type]
