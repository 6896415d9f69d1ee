import itertools

import pytest
import torch
from safetensors.torch import load, save

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.strategies import ClientSlot, build_strategy
from device_agent.clients import build_program
from device_agent.models import build_model
from tests.coordinator.strategies.personal_helpers import CNN, nbytes, run_round, slots


def test_clients_upload_u_of_every_shared_layer_plus_second_to_last_v():
    strategy = build_strategy("factorized_fl", CNN, {"share_head": True})
    uploads = run_round(strategy, 0, slots(2), {})
    assert sorted(uploads["dev-0"]) == ["conv1.u", "conv2.u", "conv3.u", "conv3.v", "fc.u"]
    dense = nbytes(build_model("cnn", 4).state_dict())
    assert dense / nbytes(uploads["dev-0"]) >= 10


def test_head_stays_on_the_device_by_default_and_later_rounds_send_only_u():
    strategy = build_strategy("factorized_fl", CNN)
    kept: dict = {}
    first = strategy.configure(0, slots(2))["dev-0"]
    assert "conv2.mu" in first.tensors  # a first assignment is the whole model
    run_round(strategy, 0, slots(2), kept)
    later = strategy.configure(1, slots(2))["dev-0"].tensors
    assert sorted(later) == ["conv1.u", "conv2.u", "conv3.u"]
    assert not torch.equal(kept["dev-0"]["conv2.v"], strategy.init_state["conv2.v"])
    program = build_program(strategy.configure(1, slots(2))["dev-0"].spec, later, kept["dev-0"])
    assert torch.equal(program.model.conv2.v, kept["dev-0"]["conv2.v"])  # private v from the device
    assert torch.equal(program.model.conv2.u, later["conv2.u"])  # personalized u from the server


def test_a_device_that_lost_its_kept_state_is_told():
    strategy = build_strategy("factorized_fl", CNN)
    run_round(strategy, 0, slots(2), {})
    with pytest.raises(ValueError, match="kept no state"):
        run_round(strategy, 1, slots(2), {})


def synthetic_uploads(strategy, ids, seed=0):
    gen = torch.Generator().manual_seed(seed)
    contract = strategy.upload_contract(ClientSlot(ids[0], 1.0, 10))
    return {c: {k: torch.randn(v.shape, generator=gen) for k, v in contract.tensors.items()} for c in ids}


@pytest.mark.parametrize("name", ["factorized_fl", "factorized_fl_beta"])
def test_personalized_aggregation_is_independent_of_client_order(name):
    ids = ["a", "b", "c", "d"]
    uploads = synthetic_uploads(build_strategy(name, CNN), ids)
    results = []
    for order in itertools.islice(itertools.permutations(ids), 0, 24, 7):
        strategy = build_strategy(name, CNN, {"tau": 0.0, "eps": 5.0})
        aggregate = strategy.open_round(0, [ClientSlot(c, 1.0, 10) for c in ids])
        for client in order:
            aggregate.add(client, uploads[client], 10 + ids.index(client))
        strategy.close_round(aggregate)
        results.append({c: strategy.personalized_state(c) for c in ids})
    for other in results[1:]:
        for client in ids:
            for key, value in results[0][client].items():
                assert torch.equal(value, other[client][key]), (client, key)


def test_dissimilar_clients_do_not_mix_and_similar_ones_average():
    strategy = build_strategy("factorized_fl", CNN, {"tau": 0.5, "eps": 3.0})
    ids = ["a", "b", "c"]
    uploads = synthetic_uploads(strategy, ids)
    v = uploads["a"]["conv3.v"]
    orthogonal = torch.zeros_like(v)
    orthogonal[0] = 1.0
    v = v.clone()
    v[0] = 0.0
    uploads["a"]["conv3.v"], uploads["b"]["conv3.v"], uploads["c"]["conv3.v"] = v, 2 * v, orthogonal
    aggregate = strategy.open_round(0, [ClientSlot(c, 1.0, 10) for c in ids])
    for client in ids:
        aggregate.add(client, uploads[client], 10)
    strategy.close_round(aggregate)
    expected_ab = (uploads["a"]["conv2.u"] + uploads["b"]["conv2.u"]) / 2  # cosine 1 -> equal weights
    torch.testing.assert_close(strategy.personalized_state("a")["conv2.u"], expected_ab)
    torch.testing.assert_close(strategy.personalized_state("b")["conv2.u"], expected_ab)
    torch.testing.assert_close(strategy.personalized_state("c")["conv2.u"], uploads["c"]["conv2.u"])


def test_beta_mixes_v_and_mu_too():
    strategy = build_strategy("factorized_fl_beta", CNN)
    uploads = run_round(strategy, 0, slots(2), {})
    assert {"conv2.v", "conv2.mu"} <= set(uploads["dev-0"])
    assert {"conv2.v", "conv2.mu"} <= set(strategy.personalized_state("dev-1"))


@pytest.mark.parametrize("name", ["factorized_fl", "factorized_fl_beta"])
def test_state_dict_round_trips_through_safetensors(name):
    strategy = build_strategy(name, CNN, seed=3)
    run_round(strategy, 0, slots(2), {})
    restored = build_strategy(name, CNN, seed=99)
    restored.load_state_dict(load(save(strategy.state_dict())))
    for client in ("dev-0", "dev-1", "new"):
        a = strategy.configure(1, [ClientSlot(client, 1.0, 5)])[client].tensors
        b = restored.configure(1, [ClientSlot(client, 1.0, 5)])[client].tensors
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = restored.global_model()
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 4)


def test_bad_uploads_are_rejected_by_name():
    strategy = build_strategy("factorized_fl", CNN)
    ids = ["a"]
    upload = synthetic_uploads(strategy, ids)["a"]
    aggregate = strategy.open_round(0, [ClientSlot("a", 1.0, 10)])
    contract = strategy.upload_contract(ClientSlot("a", 1.0, 10))
    contract.check(upload)
    with pytest.raises(UpdateRejected, match=r"'conv2\.mu': not a tensor a device at this level sends"):
        contract.check({**upload, "conv2.mu": torch.zeros(9, 2048)})
    with pytest.raises(UpdateRejected, match=r"'conv1\.u': shape \(4,\)"):
        contract.check({**upload, "conv1.u": torch.zeros(4)})
    with pytest.raises(UpdateRejected, match="NaN"):
        contract.check({**upload, "conv1.u": torch.full((9,), float("nan"))})
    with pytest.raises(UpdateRejected, match="not part of round"):
        aggregate.add("b", upload, 10)
    aggregate.add("a", upload, 10)
    with pytest.raises(UpdateRejected, match="already uploaded"):
        aggregate.add("a", upload, 10)


def test_parameters_are_validated_by_name():
    with pytest.raises(ValueError, match="eps"):
        build_strategy("factorized_fl", CNN, {"eps": 0})
    with pytest.raises(ValueError, match="lambda"):
        build_strategy("factorized_fl", CNN, {"lambda": 1e-3})
