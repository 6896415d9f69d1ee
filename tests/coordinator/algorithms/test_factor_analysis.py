import math

import pytest
import torch

from coordinator.algorithms.factor_analysis import (
    communalities,
    correlation,
    eigen_descending,
    element_matrix,
    number_of_factors,
    principal_factor_loadings,
    split_elements,
    threshold,
)


def paper_simulation(clients=20, d=100, m=200, shared=0.5, alpha=0.5, seed=0):
    """Seed 002 Sec. 4.3.1: one hidden layer of m neurons; the last shared*m neurons are shared.

    Shared neurons: w_sp ~ U(-0.1, 0.1) on the d1 personal covariates, w_ss ~ U(-1, 1) on the d2
    shared ones, identical for every client. Personal neurons of client c: w_pp ~ N(mu_c, I),
    mu_c ~ N(0, I), and w_ps ~ U(-0.1, 0.1). Returns each client's (m, d) weight and the truth.
    """
    gen = torch.Generator().manual_seed(seed)
    d2 = int(alpha * d)
    d1, m2 = d - d2, int(shared * m)
    m1 = m - m2

    def uniform(rows, cols, bound):
        return (torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 2 - 1) * bound

    shared_rows = torch.cat([uniform(m2, d1, 0.1), uniform(m2, d2, 1.0)], 1)
    weights = []
    for _ in range(clients):
        mean = torch.randn(d1, generator=gen, dtype=torch.float64)
        personal = torch.cat([mean + torch.randn(m1, d1, generator=gen, dtype=torch.float64), uniform(m1, d2, 0.1)], 1)
        weights.append(torch.cat([personal, shared_rows], 0))
    return weights, torch.arange(m) >= m1


@pytest.mark.slow
@pytest.mark.parametrize(("shared", "alpha"), [(0.5, 0.5), (0.75, 0.25), (0.5, 0.75)])
def test_principal_factors_recover_the_paper_simulations_split(shared, alpha):
    weights, truth = paper_simulation(shared=shared, alpha=alpha)
    split = split_elements(weights, kappa=0.85, quantile=1 - shared)
    rate = float((split.shared == truth).double().mean())
    print(f"shared={shared} alpha={alpha}: G={split.num_factors}, recovery rate {rate:.3f}")
    assert rate >= 0.9


def test_element_matrix_stacks_clients_as_observations():
    a = torch.arange(6.0).reshape(2, 3)  # 2 elements of length 3
    b = a + 10
    x = element_matrix([a, b])
    assert x.shape == (6, 2)
    torch.testing.assert_close(x[:, 0], torch.tensor([0.0, 1, 2, 10, 11, 12], dtype=torch.float64))


@pytest.mark.parametrize(("kappa", "expected"), [(0.5, 1), (0.75, 2), (0.7501, 3), (0.874, 3), (0.875, 3), (1.0, 5)])
def test_number_of_factors_is_the_smallest_m_reaching_kappa(kappa, expected):
    # shares: 0.5, 0.75, 0.875, 0.9375, 1.0 (exact in binary)
    assert number_of_factors(torch.tensor([4.0, 2.0, 1.0, 0.5, 0.5], dtype=torch.float64), kappa) == expected


def test_number_of_factors_on_a_correlation_matrix_with_a_known_spectrum():
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    spectrum = torch.tensor([3.0, 1.5, 0.6, 0.4, 0.3, 0.2], dtype=torch.float64)  # sums to 6 = trace of R
    values, _ = eigen_descending(q @ torch.diag(spectrum) @ q.T)
    assert number_of_factors(values, 0.75) == 2  # 4.5 / 6 = 0.75 exactly
    assert number_of_factors(values, 0.76) == 3


def test_principal_factors_recover_the_loadings_of_a_factor_model():
    loadings = torch.tensor(
        [[0.9, 0.0], [0.8, 0.3], [0.7, -0.4], [0.0, 0.8], [0.2, 0.7], [0.0, 0.0]], dtype=torch.float64
    )
    psi = 1 - (loadings**2).sum(1)
    r = loadings @ loadings.T + torch.diag(psi)
    estimate = principal_factor_loadings(r, 2)
    torch.testing.assert_close(
        estimate @ estimate.T - torch.diag((estimate @ estimate.T).diagonal()),
        r - torch.eye(6, dtype=torch.float64),
        atol=1e-4,
        rtol=0,
    )
    torch.testing.assert_close(communalities(estimate), (loadings**2).sum(1), atol=1e-4, rtol=0)


def test_correlation_of_a_constant_column_is_zero_off_diagonal():
    x = torch.tensor([[1.0, 5.0], [2.0, 5.0], [4.0, 5.0]], dtype=torch.float64)
    torch.testing.assert_close(correlation(x), torch.eye(2, dtype=torch.float64))


def test_threshold_quantiles_and_all_private():
    nu = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5], dtype=torch.float64)
    assert threshold(nu, 0.5) == pytest.approx(0.3)
    assert threshold(nu, None) == math.inf
    with pytest.raises(ValueError, match="quantile"):
        threshold(nu, 1.5)


def test_all_private_threshold_shares_nothing():
    weights, _ = paper_simulation(clients=4, m=20, d=10)
    assert not split_elements(weights, quantile=None).shared.any()


def test_mismatched_client_shapes_are_named():
    with pytest.raises(ValueError, match="client 1"):
        element_matrix([torch.zeros(3, 2), torch.zeros(2, 3)])
