"""The LoRA aggregation rules on tiny layers whose results are worked out by hand below."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.algorithms.lora import (
    ClientFactors,
    average_factors,
    average_products,
    sparsity_weights,
    stack,
    svd_rule,
    zero_pad_average,
)


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# A 3x3 layer: client 1 at rank 1 (weight 1), client 2 at rank 2 (weight 3), so w = 1/4, 3/4.
#   B1 A1 = [1 0 2]^T [1 1 0]          = [[1,1,0],[0,0,0],[2,2,0]]
#   B2 A2 = [[0,1],[1,0],[0,0]] [[0,2,0],[1,0,1]] = [[1,0,1],[0,2,0],[0,0,0]]
#   1/4 B1 A1 + 3/4 B2 A2               = [[1,.25,.75],[0,1.5,0],[.5,.5,0]]
ONE = ClientFactors(expand=t([[1], [0], [2]]), reduce=t([[1, 1, 0]]), weight=1.0)
TWO = ClientFactors(expand=t([[0, 1], [1, 0], [0, 0]]), reduce=t([[0, 2, 0], [1, 0, 1]]), weight=3.0)
MEAN_PRODUCT = t([[1, 0.25, 0.75], [0, 1.5, 0], [0.5, 0.5, 0]])


def test_average_products_is_the_weighted_mean_of_the_clients_updates() -> None:
    torch.testing.assert_close(average_products([ONE, TWO]), MEAN_PRODUCT)


def test_flora_stacks_a_scaled_by_the_weights_and_b_as_it_is() -> None:
    reduce, expand = stack([ONE, TWO])

    torch.testing.assert_close(reduce, t([[0.25, 0.25, 0], [0, 1.5, 0], [0.75, 0, 0.75]]))
    torch.testing.assert_close(expand, t([[1, 0, 1], [0, 1, 0], [2, 0, 0]]))
    torch.testing.assert_close(expand @ reduce, MEAN_PRODUCT)


def test_hetlora_zero_pads_to_the_global_rank_averages_and_each_rank_takes_its_leading_part() -> None:
    # A1 padded [[1,1,0],[0,0,0]]: 1/4 of it + 3/4 [[0,2,0],[1,0,1]] = [[.25,1.75,0],[.75,0,.75]]
    # B1 padded [[1,0],[0,0],[2,0]]: 1/4 of it + 3/4 [[0,1],[1,0],[0,0]] = [[.25,.75],[.75,0],[.5,0]]
    reduce, expand = zero_pad_average([ONE, TWO], rank=2, weights=[1.0, 3.0])

    torch.testing.assert_close(reduce, t([[0.25, 1.75, 0], [0.75, 0, 0.75]]))
    torch.testing.assert_close(expand, t([[0.25, 0.75], [0.75, 0], [0.5, 0]]))
    # Not exact: row 0 of B A is .25 [.25,1.75,0] + .75 [.75,0,.75] = [.625,.4375,.5625], not [1,.25,.75].
    torch.testing.assert_close((expand @ reduce)[0], t([[0.625, 0.4375, 0.5625]])[0])
    # The rank-1 client receives the first row of A and the first column of B.
    torch.testing.assert_close(reduce[:1], t([[0.25, 1.75, 0]]))
    torch.testing.assert_close(expand[:, :1], t([[0.25], [0.75], [0.5]]))


def test_hetlora_pads_beyond_every_client_with_zeros() -> None:
    reduce, expand = zero_pad_average([ONE, TWO], rank=3, weights=[1.0, 1.0])

    assert reduce.shape == (3, 3) and expand.shape == (3, 3)
    assert not reduce[2].any() and not expand[:, 2].any()


def test_hetlora_sparsity_weights_are_the_frobenius_norms_of_the_updates_normalized() -> None:
    # ||B1 A1||_F = sqrt(1+1+4+4) = sqrt(10); ||B2 A2||_F = sqrt(1+4+1) = sqrt(6); the sample weights play no part.
    total = math.sqrt(10) + math.sqrt(6)

    assert sparsity_weights([ONE, TWO]) == pytest.approx([math.sqrt(10) / total, math.sqrt(6) / total])


def test_the_papers_rule_keeps_the_largest_singular_direction_at_rank_1_and_all_at_full_rank() -> None:
    # A 4x2 layer: 1/4 [2 0 0 0]^T [1 0] + 3/4 [0 1 0 0]^T [0 1] = [[.5,0],[0,.75],[0,0],[0,0]];
    # singular values .75 (e2 -> e2) and .5 (e1 -> e1), so rank 1 keeps only the .75 entry.
    first = ClientFactors(expand=t([[2], [0], [0], [0]]), reduce=t([[1, 0]]), weight=1.0)
    second = ClientFactors(expand=t([[0], [1], [0], [0]]), reduce=t([[0, 1]]), weight=3.0)

    factors = svd_rule([first, second], ranks=[1, 2])

    reduce, expand = factors[1]
    torch.testing.assert_close(expand @ reduce, t([[0, 0], [0, 0.75], [0, 0], [0, 0]]))
    torch.testing.assert_close(reduce.abs(), t([[0, 1]]))  # A's rows stay orthonormal
    reduce, expand = factors[2]
    torch.testing.assert_close(expand @ reduce, t([[0.5, 0], [0, 0.75], [0, 0], [0, 0]]))


def test_fedit_averages_each_factor_so_its_product_is_not_the_mean_of_products() -> None:
    # mean A = ([1,0,1] + [0,2,0]) / 2 = [.5,1,.5]; mean B = ([1,2,0] + [3,0,1]) / 2 = [2,1,.5]
    first = ClientFactors(expand=t([[1], [2], [0]]), reduce=t([[1, 0, 1]]), weight=1.0)
    second = ClientFactors(expand=t([[3], [0], [1]]), reduce=t([[0, 2, 0]]), weight=1.0)

    reduce, expand = average_factors([first, second])

    torch.testing.assert_close(reduce, t([[0.5, 1, 0.5]]))
    torch.testing.assert_close(expand, t([[2], [1], [0.5]]))
    # mean B mean A = [[1,2,1],[.5,1,.5],[.25,.5,.25]]; the mean of products is [[.5,3,.5],[1,0,1],[0,1,0]].
    torch.testing.assert_close(expand @ reduce, t([[1, 2, 1], [0.5, 1, 0.5], [0.25, 0.5, 0.25]]))
    torch.testing.assert_close(average_products([first, second]), t([[0.5, 3, 0.5], [1, 0, 1], [0, 1, 0]]))


def test_fedit_refuses_mixed_ranks() -> None:
    with pytest.raises(ValueError, match="one rank"):
        average_factors([ONE, TWO])


def _random_clients(seed: int, ranks: list[int], shape: tuple[int, int] = (7, 5)) -> list[ClientFactors]:
    gen = torch.Generator().manual_seed(seed)
    out, inp = shape
    return [
        ClientFactors(
            expand=torch.randn(out, r, generator=gen, dtype=torch.float64),
            reduce=torch.randn(r, inp, generator=gen, dtype=torch.float64),
            weight=float(torch.randint(1, 50, (), generator=gen)),
        )
        for r in ranks
    ]


@pytest.mark.parametrize("seed", range(5))
def test_flora_aggregate_is_exactly_the_weighted_sum_of_the_clients_products(seed: int) -> None:
    clients = _random_clients(seed, [1, 2, 4, 3])
    total = sum(c.weight for c in clients)
    expected = torch.zeros(7, 5, dtype=torch.float64)
    for c in clients:
        expected += (c.weight / total) * (c.expand @ c.reduce)

    reduce, expand = stack(clients)

    assert reduce.shape == (10, 5) and expand.shape == (7, 10)
    torch.testing.assert_close(expand @ reduce, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_the_papers_rule_at_full_rank_is_the_average_of_products(seed: int) -> None:
    clients = _random_clients(seed, [1, 2, 5])
    total = sum(c.weight for c in clients)
    expected = sum((c.weight / total) * (c.expand @ c.reduce) for c in clients)

    reduce, expand = svd_rule(clients, ranks=[5])[5]

    torch.testing.assert_close(expand @ reduce, expected, rtol=1e-10, atol=1e-10)
