import pytest
import torch
import torch.nn.functional as F

from device_agent.layers.factorized import (
    FactorizedConv2d,
    FactorizedLinear,
    matrices_to_factors,
    matrix_to_weight,
    rank_for,
    reconstruct,
    spectral_factors,
    weight_to_matrix,
)


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", [0, 1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_two_stage_conv_equals_dense_conv_of_reconstructed_weight(kernel_size, stride, padding, bias):
    torch.manual_seed(kernel_size * 100 + stride * 10 + padding)
    layer = FactorizedConv2d(6, 10, kernel_size, rank=4, stride=stride, padding=padding, bias=bias).double()
    if bias:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 6, 11, 9, dtype=torch.float64)
    dense = reconstruct(layer.reduce, layer.expand, layer.weight_shape)
    expected = F.conv2d(x, dense, layer.bias, stride=stride, padding=padding)
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


def test_factorized_linear_equals_dense_linear():
    torch.manual_seed(0)
    layer = FactorizedLinear(20, 7, rank=3).double()
    x = torch.randn(5, 20, dtype=torch.float64)
    dense = reconstruct(layer.reduce, layer.expand, layer.weight_shape)
    torch.testing.assert_close(layer(x), F.linear(x, dense, layer.bias))


def test_matrix_view_round_trips_a_conv_weight():
    weight = torch.randn(8, 5, 3, 3)
    matrix = weight_to_matrix(weight)
    assert matrix.shape == (8 * 3, 5 * 3)
    assert matrix[2 * 3 + 1, 4 * 3 + 2] == weight[2, 4, 1, 2]
    torch.testing.assert_close(matrix_to_weight(matrix, weight.shape), weight, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(16, 8, 3, 3), (8, 16, 3, 3), (32, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_rank_factorization_reconstructs_the_weight(shape, dtype):
    torch.manual_seed(1)
    weight = torch.randn(shape, dtype=dtype)
    matrix = weight_to_matrix(weight)
    a, b = spectral_factors(matrix, min(matrix.shape))
    rebuilt = reconstruct(*matrices_to_factors(a, b, shape), shape)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-10
    assert float((rebuilt - weight).norm() / weight.norm()) < tolerance


def test_truncation_gives_the_eckart_young_optimal_error_at_every_rank():
    torch.manual_seed(2)
    matrix = torch.randn(96, 48) @ torch.diag(torch.logspace(0, -2, 48)) @ torch.randn(48, 48)
    singular_values = torch.linalg.svdvals(matrix.double())
    a, b = spectral_factors(matrix, 24)
    for rank in (1, 3, 6, 12, 24):
        error = float((matrix - a[:, :rank] @ b[:rank]).double().norm())
        optimal = float(singular_values[rank:].norm())
        assert error == pytest.approx(optimal, rel=1e-4)


def test_spectral_factors_are_balanced_like_fedhm():
    torch.manual_seed(3)
    matrix = torch.randn(30, 20, dtype=torch.float64)
    a, b = spectral_factors(matrix, 5)
    torch.testing.assert_close(a.norm(dim=0), b.norm(dim=1))


def test_rank_is_a_rounded_fraction_of_output_channels():
    assert rank_for(1.0, 512) == 512
    assert rank_for(0.125, 64) == 8
    assert rank_for(0.5, 5) == 3
    assert rank_for(0.01, 10) == 1
    with pytest.raises(ValueError, match="gamma"):
        rank_for(0.0, 10)
    with pytest.raises(ValueError, match="gamma"):
        rank_for(1.5, 10)


def test_rank_above_the_matrix_rank_is_zero_padded():
    matrix = torch.randn(12, 3, dtype=torch.float64)
    a, b = spectral_factors(matrix, 5)
    assert a.shape == (12, 5) and b.shape == (5, 3)
    torch.testing.assert_close(a @ b, matrix)
    assert not a[:, 3:].any() and not b[3:].any()


def ill_conditioned(rows, cols, decades, seed=0):
    """A float32 matrix with singular values spread evenly over ``decades`` decades, and them (float64)."""
    generator = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    left, _ = torch.linalg.qr(torch.randn(rows, k, dtype=torch.float64, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(cols, k, dtype=torch.float64, generator=generator))
    singular_values = torch.logspace(0, -decades, k, dtype=torch.float64)
    return ((left * singular_values) @ right.T).float(), singular_values


@pytest.mark.parametrize("shape", [(192, 96), (96, 192)])
@pytest.mark.parametrize("rank", [48, 96])
def test_an_ill_conditioned_float32_matrix_keeps_near_optimal_reconstruction(shape, rank):
    # Six decades: the kept spectrum spans three (rank 48) or six (rank 96). The float32 Gram
    # route alone misses the optimum by 3e-5 to 2e-4 here; float64 for such layers by < 1e-6.
    matrix, singular_values = ill_conditioned(*shape, decades=6)
    a, b = spectral_factors(matrix, rank)
    assert a.dtype == b.dtype == torch.float32
    exact = matrix.double()
    error = float((exact - a.double() @ b.double()).norm() / exact.norm())
    optimal = float(singular_values[rank:].norm() / singular_values.norm())
    assert error - optimal < 1e-6


def test_null_components_are_balanced():
    # Rank 8 in a 40 x 24 matrix: components 8..23 are null, their eigenvalues rounding noise.
    torch.manual_seed(4)
    matrix = torch.randn(40, 8) @ torch.randn(8, 24)
    for candidate in (matrix, matrix.T.contiguous()):
        a, b = spectral_factors(candidate, 24)
        ratio = a.norm(dim=0) / b.norm(dim=1)
        torch.testing.assert_close(ratio, torch.ones(24), rtol=1e-3, atol=0)
        assert float(b[8:].norm(dim=1).max()) < 1e-2 * float(b[0].norm())
        torch.testing.assert_close(a @ b, candidate, rtol=0, atol=1e-4)
