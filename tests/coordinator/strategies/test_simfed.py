import itertools

import pytest
import torch
from safetensors.torch import load, save

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.strategies import ClientSlot, build_strategy
from device_agent.layers import rank_one_layers
from tests.coordinator.strategies.personal_helpers import CNN, run_round, slots


def test_clients_return_their_model_and_the_criteria_embedding():
    strategy = build_strategy("simfed", CNN, {"criteria_batch": 2})
    assignment = strategy.configure(0, slots(1))["dev-0"]
    assert assignment.spec.layout == "channel"
    assert assignment.tensors["criteria"].shape == (2, 1, 8, 8)
    run_round(strategy, 0, slots(2), {})
    state = strategy.personalized_state("dev-0")
    assert state is not None and "conv2.mu" in state and "bn2.running_mean" in state


def test_reflection_of_two_clients_matches_eq8_by_hand():
    strategy = build_strategy("simfed", CNN, {"alpha": 2.0, "tau": -1.0})
    ids = ["a", "b"]
    aggregate = strategy.open_round(0, [ClientSlot(c, 1.0, 10) for c in ids])
    gen = torch.Generator().manual_seed(0)
    uploads = {
        c: {
            k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
            for k, v in strategy.init_state.items()
        }
        for c in ids
    }
    embeddings = {"a": torch.zeros(strategy.embedding_size), "b": torch.zeros(strategy.embedding_size)}
    embeddings["a"][0], embeddings["b"][0], embeddings["b"][1] = 1.0, 1.0, 1.0  # cosine 1/sqrt(2)
    for c in ids:
        aggregate.add(c, uploads[c], 10, {"embedding": embeddings[c]})
    strategy.close_round(aggregate)
    sigma = 2.0**-0.5
    w_other = torch.exp(torch.tensor(2.0 * sigma)) / (
        torch.exp(torch.tensor(2.0)) + torch.exp(torch.tensor(2.0 * sigma))
    )
    for key in ("conv2.u", "conv2.v", "conv2.mu"):
        expected_a = uploads["a"][key] + w_other * (uploads["b"][key] - uploads["a"][key])
        torch.testing.assert_close(strategy.personalized_state("a")[key], expected_a)
    # BatchNorm and the (unshared) classifier stay each client's own
    assert torch.equal(strategy.personalized_state("a")["bn2.weight"], uploads["a"]["bn2.weight"])
    assert torch.equal(strategy.personalized_state("a")["fc.u"], uploads["a"]["fc.u"])


def test_reflection_is_independent_of_client_order():
    ids = ["x", "y", "z"]
    gen = torch.Generator().manual_seed(1)
    base = build_strategy("simfed", CNN)
    uploads = {
        c: {
            k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
            for k, v in base.init_state.items()
        }
        for c in ids
    }
    extras = {c: {"embedding": torch.randn(base.embedding_size, generator=gen)} for c in ids}
    states = []
    for order in itertools.permutations(ids):
        strategy = build_strategy("simfed", CNN, {"alpha": 4.0})
        aggregate = strategy.open_round(0, [ClientSlot(c, 1.0, 10) for c in ids])
        for c in order:
            aggregate.add(c, uploads[c], 10, extras[c])
        strategy.close_round(aggregate)
        states.append(strategy.state_dict())
    for other in states[1:]:
        assert all(torch.equal(states[0][k], other[k]) for k in states[0])


def test_state_dict_round_trip_and_newcomers_start_from_the_mean():
    strategy = build_strategy("simfed", CNN, seed=2)
    run_round(strategy, 0, slots(2), {})
    restored = build_strategy("simfed", CNN, seed=7)
    restored.load_state_dict(load(save(strategy.state_dict())))
    for client in ("dev-0", "newcomer"):
        a = strategy.configure(1, [ClientSlot(client, 1.0, 5)])[client].tensors
        b = restored.configure(1, [ClientSlot(client, 1.0, 5)])[client].tensors
        assert all(torch.equal(a[k], b[k]) for k in a)
    newcomer = strategy.configure(1, [ClientSlot("newcomer", 1.0, 5)])["newcomer"].tensors
    mean_u = (strategy.personal["dev-0"]["conv2.u"] + strategy.personal["dev-1"]["conv2.u"]) / 2
    torch.testing.assert_close(newcomer["conv2.u"], mean_u)
    global_model = restored.global_model()
    assert not rank_one_layers(global_model) and global_model(torch.randn(2, 1, 8, 8)).shape == (2, 4)


def test_missing_embedding_is_rejected():
    strategy = build_strategy("simfed", CNN)
    contract = strategy.upload_contract(ClientSlot("a", 1.0, 10))
    with pytest.raises(UpdateRejected, match="embedding"):
        contract.check(dict(strategy.init_state))
    contract.check(dict(strategy.init_state), {"embedding": torch.zeros(strategy.embedding_size)})
