import pytest
import torch

from coordinator.algorithms.aggregation import UpdateRejected
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


def test_label_masked_fedhm_asks_low_rank_clients_for_their_classes_and_masks_their_rows():
    strategy = build_strategy("fedhm", SPEC, {"weighting": "uniform", "label_masked_classifier": "renormalised"}, 0)
    before = strategy.global_state()["fc.weight"].clone()
    clients = [ClientSlot("full", 1.0, 20), ClientSlot("low", 0.25, 20)]
    sent = strategy.configure(1, clients)
    assert not sent["full"].spec.send_classes and sent["low"].spec.send_classes
    aggregate = strategy.open_round(1, clients)
    programs = {cid: build_program(a.spec, a.tensors) for cid, a in sent.items()}
    programs["low"].note_local_classes(torch.tensor([3, 7]))
    low_upload = {k: v + 1.0 for k, v in programs["low"].upload().items()}
    with pytest.raises(UpdateRejected, match="'classes'"):
        strategy.upload_contract(clients[1]).check(low_upload, {})
    strategy.upload_contract(clients[1]).check(low_upload, programs["low"].extras())
    strategy.upload_contract(clients[0]).check(programs["full"].upload(), programs["full"].extras())
    aggregate.add("full", programs["full"].upload(), 20, programs["full"].extras())
    aggregate.add("low", low_upload, 20, programs["low"].extras())
    strategy.close_round(aggregate)
    after = strategy.global_state()["fc.weight"]
    # Rows 3 and 7: the mean of the unchanged full-rank row and the shifted low-rank one (+0.5);
    # every other row is the full-rank client's alone (unchanged), not pulled toward the +1 shift.
    shift = (after - before).mean(dim=1)
    assert shift[[3, 7]].tolist() == pytest.approx([0.5, 0.5], abs=1e-5)
    assert shift[[0, 1, 2, 4, 5, 6, 8, 9]].abs().max() < 1e-6


def test_label_masked_classifier_is_a_validated_strategy_option():
    assert build_strategy("fedhm", SPEC, {}, 0).params.label_masked_classifier.value == "off"
    with pytest.raises(ValueError, match="label_masked_classifier"):
        build_strategy("fedhm", SPEC, {"label_masked_classifier": "sometimes"}, 0)


def test_a_fedhm_variant_adds_spec_fields_without_copying_configure() -> None:
    """A proximal FedHM: its spec adds ``mu``; the subclass names its program and fields, nothing else."""
    from typing import Literal

    from coordinator.strategies.fedhm import FedHM
    from device_agent.clients.fedhm import FedHMProgram
    from device_agent.clients.spec import FedHMSpec

    class ProxSpec(FedHMSpec):
        strategy: Literal["fedhm_prox_test"]  # type: ignore[assignment]
        mu: float

    class ProxProgram(FedHMProgram, register=False):
        Spec = ProxSpec

    class ProxFedHM(FedHM, register=False):
        name = "fedhm_prox_test"
        program = ProxProgram

        def spec_fields(self) -> dict[str, object]:
            return {"mu": 0.25}

    strategy = ProxFedHM(ModelSpec("cnn", 10, 1, 8), FedHM.Params())
    sent = strategy.configure(1, [ClientSlot("a", 0.5, 10), ClientSlot("b", 1.0, 10)])
    assert {type(a.spec) for a in sent.values()} == {ProxSpec}
    assert [(a.spec.strategy, a.spec.level, a.spec.mu) for a in sent.values()] == [
        ("fedhm_prox_test", 0.5, 0.25),
        ("fedhm_prox_test", 1.0, 0.25),
    ]
    assert set(sent["a"].tensors) == set(strategy.client_model(strategy.model, strategy.params, 0.5).state_dict())
