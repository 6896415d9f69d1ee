import torch

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients import build_program
from device_agent.layers.hybrid import factorization_plan

SPEC = ModelSpec("cnn", 10, 1, 8)


def test_fedhm_round_trip_sends_factors_and_rebuilds_the_full_model():
    strategy = build_strategy("fedhm", SPEC, {"weighting": "uniform"}, seed=3)
    clients = [ClientSlot("a", 1.0, 20), ClientSlot("b", 0.25, 20)]
    sent = strategy.configure(1, clients)
    assert "conv2.reduce" in sent["b"].tensors and "conv2.weight" not in sent["b"].tensors
    assert "conv2.weight" in sent["a"].tensors
    aggregate = strategy.open_round(1, clients)
    uploads = {}
    for cid, assignment in sent.items():
        program = build_program(assignment.spec, assignment.tensors)
        uploads[cid] = program.upload()
        aggregate.add(cid, uploads[cid], 20)
    assert not any(k.endswith("conv2.weight") for k in uploads["b"])
    strategy.close_round(aggregate)
    plan = factorization_plan("cnn")
    b = uploads["b"]
    rebuilt_b = strategy.global_state()["conv2.weight"] * 2 - uploads["a"]["conv2.weight"]
    low_rank = torch.linalg.matrix_rank(rebuilt_b.permute(0, 2, 1, 3).reshape(64 * 3, 32 * 3), atol=1e-4)
    assert int(low_rank) == plan["conv2"].rank(0.25) == b["conv2.reduce"].shape[0]


def test_fedhm_state_dict_round_trips():
    strategy = build_strategy("fedhm", SPEC, {}, seed=1)
    other = build_strategy("fedhm", SPEC, {}, seed=2)
    other.load_state_dict(strategy.state_dict())
    for key, value in strategy.global_state().items():
        assert torch.equal(other.global_state()[key], value)
