"""FedBuff's server side: staleness weights, model versions, K-update publishing and the bounds it enforces."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.asynchronous import AsyncSettings, StalenessWeight
from coordinator.rounds.fedbuff import FedBuff, TooStale
from coordinator.strategies import ClientSlot, ModelSpec, Strategy, build_strategy
from device_agent.clients.base import is_norm_statistic

SPEC = ModelSpec("cnn", 10, 1, 8)


def trained(sent: dict[str, Tensor], seed: int, scale: float = 0.01) -> dict[str, Tensor]:
    """What a device uploads after training on ``sent``: its trainable tensors, moved a little."""
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=generator)
        for k, v in sent.items()
        if v.is_floating_point() and not is_norm_statistic(k)
    }


def fedbuff(strategy: str = "fedavg", params: dict | None = None, **settings: object) -> FedBuff:
    return FedBuff(build_strategy(strategy, SPEC, params, seed=0), AsyncSettings(**settings))


def slot(device: str, level: float = 1.0) -> ClientSlot:
    return ClientSlot(device, level, 50)


def answer(server: FedBuff, device: str, seed: int, level: float = 1.0):
    """Assign ``device`` the newest version, train it, check and fold its update."""
    version, assignment = server.assign(slot(device, level))
    upload = trained(assignment.tensors, seed)
    server.check(slot(device, level), version, upload, 50)
    return server.fold(slot(device, level), version, upload, 50)


def test_a_version_is_published_every_k_updates() -> None:
    server = fedbuff(buffer=3)
    assert [answer(server, f"d{i}", i) for i in range(2)] == [None, None]
    assert (server.version, server.buffered) == (0, 2)
    published = answer(server, "d2", 2)
    assert published is not None and published.version == 1 == server.version
    assert [u.device for u in published.updates] == ["d0", "d1", "d2"]
    assert (server.buffered, server.updates_per_version) == (0, {1: 3})


def test_fresh_updates_of_a_full_buffer_are_the_synchronous_round() -> None:
    """K = every device, staleness 0, server_lr 1 and equal samples: FedBuff's step is FedAvg's round."""
    sync = build_strategy("fedavg", SPEC, seed=0)
    server = fedbuff(buffer=3)
    slots = [slot(f"d{i}") for i in range(3)]
    sent = sync.configure(1, slots)
    round_ = sync.open_round(1, slots)
    for i, s in enumerate(slots):
        round_.add(s.client_id, trained(sent[s.client_id].tensors, i), 50)
    sync.close_round(round_)
    for i in range(3):
        answer(server, f"d{i}", i)
    assert_same(server.strategy.global_state(), sync.global_state())


@pytest.mark.parametrize(
    "params",
    [{"weighting": "uniform"}, {}, {"weighting": "paper", "temperature": 0.1}, {"weighting": "reference"}],
    ids=["uniform", "paper-softmax", "paper-tau-0.1", "reference"],
)
def test_fedhm_devices_train_at_their_rank_and_are_folded_in_the_full_rank_space_as_a_round_does(params) -> None:
    """Each level weighted as a sync FedHM round weights it (softmax(gamma / tau) by default) within the buffer."""
    levels = {"d0": 1.0, "d1": 0.5, "d2": 0.25}
    sync = build_strategy("fedhm", SPEC, params, seed=0)
    slots = [slot(d, level) for d, level in levels.items()]
    sent = sync.configure(1, slots)
    round_ = sync.open_round(1, slots)
    for i, s in enumerate(slots):
        round_.add(s.client_id, trained(sent[s.client_id].tensors, i), 50)
    sync.close_round(round_)
    server = fedbuff("fedhm", params, buffer=3)
    for i, (device, level) in enumerate(levels.items()):
        version, assignment = server.assign(slot(device, level))
        assert_same(assignment.tensors, sent[device].tensors)  # the same factorization of version 0
        upload = trained(assignment.tensors, i)
        server.fold(slot(device, level), version, upload, 50)
    assert_same(server.strategy.global_state(), sync.global_state())


def test_each_published_version_is_factorized_again_for_the_next_assignments() -> None:
    server = fedbuff("fedhm", buffer=1)
    _, before = server.assign(slot("d1", 0.25))
    answer(server, "d0", 0)
    version, after = server.assign(slot("d1", 0.25))
    expected = server.strategy.configure(version, [slot("d1", 0.25)])["d1"].tensors
    assert version == 1 and after.tensors.keys() == before.tensors.keys()
    assert_same(after.tensors, expected)
    assert any(not torch.equal(after.tensors[k], before.tensors[k]) for k in after.tensors)


def test_a_stale_update_is_discounted_by_its_staleness_weight_and_moves_the_model_by_the_server_lr() -> None:
    server = fedbuff(buffer=1, server_lr=0.5, staleness_weight=StalenessWeight(rule="polynomial", exponent=1.0))
    version, assignment = server.assign(slot("slow"))
    answer(server, "fast", 1)
    answer(server, "fast", 2)  # two versions published while "slow" trained
    upload = trained(assignment.tensors, 3)
    current = server.strategy.global_state()
    assert server.check(slot("slow"), version, upload, 50) == 2
    published = server.fold(slot("slow"), version, upload, 50)
    assert published is not None and published.updates[0].weight == pytest.approx(1 / 3)
    for key, value in upload.items():  # FedAvg's one-device round ends at the upload: the update is upload - base
        step = 0.5 * (1 / 3) * (value - assignment.tensors[key])
        torch.testing.assert_close(server.strategy.global_state()[key], current[key] + step)
    assert server.staleness_histogram == {0: 2, 2: 1}


def test_an_update_past_max_staleness_is_refused_with_the_numbers() -> None:
    server = fedbuff(buffer=1, max_staleness=1)
    version, assignment = server.assign(slot("slow"))
    answer(server, "fast", 1)
    answer(server, "fast", 2)
    upload = trained(assignment.tensors, 3)
    with pytest.raises(TooStale, match=r"version 0, 2 versions behind the newest \(2\); async\.max_staleness is 1"):
        server.check(slot("slow"), version, upload, 50)
    assert TooStale("x").reason == "too_stale"
    with pytest.raises(TooStale):
        server.fold(slot("slow"), version, upload, 50)
    assert server.version == 2 and server.staleness_histogram == {0: 2}


def test_an_update_for_a_version_the_device_was_not_sent_is_refused() -> None:
    server = fedbuff(buffer=2)
    _, assignment = server.assign(slot("d0"))
    upload = trained(assignment.tensors, 0)
    with pytest.raises(UpdateRejected, match="'d1' uploaded for version 0 but holds no assignment"):
        server.check(slot("d1"), 0, upload, 50)
    with pytest.raises(UpdateRejected, match="uploaded for version 3 but holds version 0"):
        server.check(slot("d0"), 3, upload, 50)
    answer(server, "d1", 1)
    server.fold(slot("d0"), 0, upload, 50)
    with pytest.raises(UpdateRejected, match="holds no assignment"):  # a second copy of the same update
        server.check(slot("d0"), 0, upload, 50)


def test_the_strategys_own_checks_refuse_a_malformed_update_and_nothing_changes() -> None:
    server = fedbuff(buffer=1)
    version, assignment = server.assign(slot("d0"))
    upload = trained(assignment.tensors, 0)
    key = next(iter(upload))
    with pytest.raises(UpdateRejected, match=key):
        server.check(slot("d0"), version, {**upload, key: upload[key][:1]}, 50)
    assert (server.version, server.buffered, dict(server.in_flight)) == (0, 0, {"d0": 0})


def test_concurrency_bounds_the_devices_training_at_once() -> None:
    server = fedbuff(buffer=5, concurrency=2)
    server.assign(slot("d0"))
    server.assign(slot("d1"))
    assert not server.can_assign()
    with pytest.raises(RuntimeError, match=r"async\.concurrency"):
        server.assign(slot("d2"))
    server.assign(slot("d1"))  # a device already training may be given the newest version instead
    server.release("d0")
    assert server.can_assign() and server.assign(slot("d2"))[0] == 0


def test_a_strategy_that_keeps_more_than_a_global_model_is_refused() -> None:
    strategy: Strategy = build_strategy("fedavg_small", SPEC, seed=0)
    with pytest.raises(TypeError, match="cannot run async"):
        FedBuff(strategy, AsyncSettings())


def assert_same(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)
