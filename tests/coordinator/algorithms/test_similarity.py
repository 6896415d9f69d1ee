import math

import pytest
import torch

from coordinator.algorithms.similarity import cosine_matrix, mix, mixing_weights, reflect


def test_cosine_matrix_has_unit_diagonal_and_known_values():
    sim = cosine_matrix(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]]))
    expected = torch.tensor(
        [[1, 1 / math.sqrt(2), 0], [1 / math.sqrt(2), 1, 1 / math.sqrt(2)], [0, 1 / math.sqrt(2), 1]]
    )
    torch.testing.assert_close(sim, expected.double())


def test_peers_below_tau_get_zero_weight_and_self_counts_with_sigma_one():
    sim = torch.tensor([[1.0, 0.9, 0.2], [0.9, 1.0, 0.5], [0.2, 0.5, 1.0]])
    w = mixing_weights(sim, tau=0.6, scale=2.0)
    e1, e09 = math.exp(2.0), math.exp(1.8)
    assert w[0].tolist() == pytest.approx([e1 / (e1 + e09), e09 / (e1 + e09), 0.0])
    assert w[2].tolist() == pytest.approx([0.0, 0.0, 1.0])


def test_min_peers_keeps_the_most_similar_even_below_tau():
    sim = torch.tensor([[1.0, 0.1, 0.3], [0.1, 1.0, 0.2], [0.3, 0.2, 1.0]])
    w = mixing_weights(sim, tau=0.95, scale=1.0, min_peers=1)
    assert w[0, 1] == 0 and w[0, 2] > 0
    assert w[1, 0] == 0 and w[1, 2] > 0
    torch.testing.assert_close(w.sum(1), torch.ones(3, dtype=torch.float64))


def test_mix_is_eq5_weighted_average():
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75]], dtype=torch.float64)
    stacked = torch.tensor([[[2.0, 0.0]], [[0.0, 4.0]]])
    out = mix(weights, stacked)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 2.0]], [[0.5, 3.0]]]))


def test_reflection_on_hand_checked_tensors():
    """theta_k + sum_j w_kj (theta_j - theta_k), worked out by hand for three clients."""
    thetas = torch.tensor([[1.0, 2.0], [3.0, 6.0], [5.0, -2.0]])
    weights = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.2, 0.0, 0.8]], dtype=torch.float64)
    out = reflect(weights, thetas)
    # client 0: [1,2] + .25*[2,4] + .25*[4,-4] = [2.5, 2.0]; client 1 untouched; client 2: [5,-2] + .2*[-4,4]
    torch.testing.assert_close(out, torch.tensor([[2.5, 2.0], [3.0, 6.0], [4.2, -1.2]]))


def test_reflection_with_softmax_weights_equals_the_weighted_average():
    torch.manual_seed(0)
    thetas = torch.randn(4, 3, 3, dtype=torch.float64)
    w = mixing_weights(cosine_matrix(torch.randn(4, 6)), tau=-1.0, scale=5.0)
    torch.testing.assert_close(reflect(w, thetas), mix(w, thetas))


def test_non_square_similarity_is_rejected():
    with pytest.raises(ValueError, match="square"):
        mixing_weights(torch.ones(2, 3), tau=0.0, scale=1.0)
