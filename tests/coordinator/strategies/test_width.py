import pytest
import torch

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.strategies.width import extract, prefix_window, rolling_window, submodel_index

SPEC = ModelSpec("cnn", 10, 1, 8)


def test_heterofl_extracts_a_prefix_of_every_hidden_dimension():
    full = {"w": torch.arange(24.0).reshape(4, 3, 2)}
    index = submodel_index(full, {"w": torch.Size([2, 3, 1])}, round=7, window=prefix_window)
    assert extract(full["w"], index["w"]).tolist() == [[[0.0], [2.0], [4.0]], [[6.0], [8.0], [10.0]]]


def test_fedrolex_window_rolls_by_one_channel_per_round():
    assert rolling_window(5, 3, 0).tolist() == [0, 1, 2]
    assert rolling_window(5, 3, 1).tolist() == [4, 0, 1]
    assert rolling_window(5, 3, 2).tolist() == [3, 4, 0]
    assert rolling_window(5, 3, 6).tolist() == rolling_window(5, 3, 1).tolist()
    full = {"w": torch.arange(20.0).reshape(5, 4)}
    index = submodel_index(full, {"w": torch.Size([3, 4])}, round=1, window=rolling_window)
    assert extract(full["w"], index["w"])[:, 0].tolist() == [16.0, 0.0, 4.0]


def slots(*levels):
    return [ClientSlot(f"c{i}", level, 10) for i, level in enumerate(levels)]


def test_heterofl_averages_each_element_over_the_clients_that_hold_it():
    strategy = build_strategy("heterofl", SPEC, {"label_masked_classifier": False})
    before = strategy.global_state()["conv1.weight"].clone()  # (32, 1, 3, 3)
    clients = slots(1.0, 0.5)
    sent = strategy.configure(1, clients)
    aggregate = strategy.open_round(1, clients)
    for value, (cid, assignment) in zip((1.0, 3.0), sent.items(), strict=True):
        upload = {k: torch.full_like(v, value) for k, v in assignment.tensors.items() if "running" not in k}
        upload = {k: v for k, v in upload.items() if v.is_floating_point()}
        aggregate.add(cid, upload, 10)
    strategy.close_round(aggregate)
    after = strategy.global_state()["conv1.weight"]
    assert before.shape == after.shape == (32, 1, 3, 3)
    assert torch.all(after[:16] == 2.0)  # held by both: (1 + 3) / 2
    assert torch.all(after[16:] == 1.0)  # held by the full-width client only


def test_label_masked_classifier_rows_count_only_for_present_classes():
    strategy = build_strategy("heterofl", SPEC, {})
    old = strategy.global_state()["fc.weight"].clone()
    clients = slots(1.0)
    sent = strategy.configure(1, clients)
    aggregate = strategy.open_round(1, clients)
    upload = {k: torch.zeros_like(v) for k, v in sent["c0"].tensors.items() if v.is_floating_point()}
    upload = {k: v for k, v in upload.items() if "running" not in k}
    aggregate.add("c0", upload, 10, {"classes": torch.tensor([2, 5])})
    strategy.close_round(aggregate)
    new = strategy.global_state()["fc.weight"]
    assert torch.all(new[[2, 5]] == 0)
    keep = [c for c in range(10) if c not in (2, 5)]
    assert torch.equal(new[keep], old[keep])


def test_width_round_rejects_bad_uploads_and_stays_untouched():
    strategy = build_strategy("fedrolex", SPEC, {})
    clients = slots(0.5)
    sent = strategy.configure(3, clients)
    upload = {k: v for k, v in sent["c0"].tensors.items() if v.is_floating_point() and "running" not in k}
    aggregate = strategy.open_round(3, clients)
    contract = strategy.upload_contract(clients[0])
    with pytest.raises(UpdateRejected, match="classes"):
        contract.check(upload)
    wrong = dict(upload, **{"conv2.weight": torch.zeros(64, 32, 3, 3)})
    with pytest.raises(UpdateRejected, match=r"conv2.weight.*shape"):
        contract.check(wrong, {"classes": torch.arange(10)})
    with pytest.raises(UpdateRejected, match=r"'classes': indices must lie in \[0, 10\)"):
        contract.check(upload, {"classes": torch.tensor([3, 10])})
    with pytest.raises(UpdateRejected, match="listed twice"):
        contract.check(upload, {"classes": torch.tensor([3, 3])})
    contract.check(upload, {"classes": torch.arange(10)})
    with pytest.raises(UpdateRejected, match="not part of round"):
        aggregate.add("stranger", upload, 10, {"classes": torch.arange(10)})
    assert all(float(s.abs().sum()) == 0 for s in aggregate.sums.values())
    aggregate.add("c0", upload, 10, {"classes": torch.arange(10)})
    with pytest.raises(UpdateRejected, match="already uploaded"):
        aggregate.add("c0", upload, 10, {"classes": torch.arange(10)})


def test_fedavg_small_trains_the_smallest_model_and_persists_its_width():
    strategy = build_strategy("fedavg_small", SPEC, {})
    sent = strategy.configure(1, slots(1.0, 0.35))
    assert {a.spec.level for a in sent.values()} == {0.35}
    assert strategy.global_state()["conv1.weight"].shape[0] == 12  # ceil(32 * 0.35)
    restored = build_strategy("fedavg_small", SPEC, {})
    restored.load_state_dict(strategy.state_dict())
    assert torch.equal(restored.global_state()["fc.weight"], strategy.global_state()["fc.weight"])


def test_params_are_validated_by_name():
    with pytest.raises(ValueError, match=r"'heterofl' parameters: weighting"):
        build_strategy("heterofl", SPEC, {"weighting": "median"})
    with pytest.raises(ValueError, match=r"bogus.*Extra inputs"):
        build_strategy("fedavg", SPEC, {"bogus": 1})
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; choose one of: .*fedhm"):
        build_strategy("nope", SPEC, {})


def test_fedavg_small_restored_from_its_initial_state_still_shrinks_to_the_first_rounds_smallest_level():
    initial = build_strategy("fedavg_small", SPEC, {}).state_dict()
    restored = build_strategy("fedavg_small", SPEC, {})
    restored.load_state_dict(initial)  # what the engine does when a run starts
    sent = restored.configure(1, slots(1.0, 0.35))
    assert {a.spec.level for a in sent.values()} == {0.35}
    again = build_strategy("fedavg_small", SPEC, {})
    again.load_state_dict(restored.state_dict())
    assert again.width == 0.35


def test_fedavg_small_opened_before_it_is_configured_aggregates_the_small_model():
    strategy = build_strategy("fedavg_small", SPEC, {})
    clients = slots(1.0, 0.35)
    aggregate = strategy.open_round(1, clients)  # the engine's order: open, then configure
    sent = strategy.configure(1, clients)
    for slot in clients:
        aggregate.add(slot.client_id, sent[slot.client_id].tensors, slot.num_samples)
    strategy.close_round(aggregate)
    assert strategy.global_state()["conv1.weight"].shape[0] == 12


@pytest.mark.parametrize("name", ["fedavg", "heterofl", "fedrolex"])
def test_devices_at_one_level_share_one_copy_of_their_sub_model(name):
    strategy = build_strategy(name, SPEC, {} if name == "fedavg" else {"label_masked_classifier": False})
    levels = (1.0, 1.0, 1.0) if name == "fedavg" else (1.0, 0.5, 0.5, 1.0)
    sent = strategy.configure(3, slots(*levels))
    by_level = {}
    for assignment in sent.values():
        by_level.setdefault(assignment.spec.level, set()).add(id(assignment.tensors))
    assert all(len(copies) == 1 for copies in by_level.values())
    assert len(by_level) == len(set(levels))
    full = strategy.global_state()["conv1.weight"]
    shared = sent["c0"].tensors["conv1.weight"]
    assert torch.equal(shared, full) and shared.data_ptr() != full.data_ptr()  # a copy, not the global tensor
