"""benchmarks.poisoning at tiny settings: the JSON's shape, and -9.5x the weights contained by the defaults."""

import json
import statistics

import pytest
import torch

from benchmarks.poisoning import (
    AT_THE_CUT_MARGIN,
    ATTACKS,
    BACKDOOR_TARGET,
    Case,
    Holding,
    Upload,
    at_the_cut,
    backdoored,
    cut_target,
    fleet_clients,
    main,
    poisoning,
    suite,
    table,
    triggered,
)
from coordinator.algorithms.robust import peer_cosines, sketch
from coordinator.config.limits import GateSettings
from coordinator.emulation.simulation import SimClient
from device_agent.data.datasets import load_dataset
from device_agent.training.optimizer import TrainConfig

TRAIN = TrainConfig(epochs=1, batch_size=32, lr=0.05)


def tiny(defense: bool) -> dict:
    return poisoning(["fedavg"], ["weights_x-9.5"], [1], rounds=3, clients=5, train=TRAIN, defense=defense)


@pytest.mark.slow
def test_one_device_uploading_minus_nine_and_a_half_times_its_weights_is_contained() -> None:
    result = tiny(defense=True)
    assert set(result) >= {"clean_accuracy", "attacks", "worst_drop_one_in_ten", "worst_drop_two_in_ten"}
    [entry] = result["attacks"]
    assert (entry["strategy"], entry["attack"], entry["malicious"]) == ("fedavg", "weights_x-9.5", 1)
    clean = result["clean_accuracy"]["fedavg"]
    assert clean > 0.6
    assert entry["accuracy"] > clean - 0.05
    assert result["worst_drop_one_in_ten"] == pytest.approx(clean - entry["accuracy"])
    assert result["worst_drop_two_in_ten"] is None  # not measured
    assert result["honest_refused_clean"] == {"fedavg": 0} and entry["honest_refused"] == 0
    assert "| fedavg | weights_x-9.5 |" in table(result)
    json.dumps(result)


@pytest.mark.slow
def test_without_the_update_bound_the_same_attack_ruins_the_model() -> None:
    [entry] = tiny(defense=False)["attacks"]
    assert entry["accuracy"] < 0.3


def test_crafted_attacks_on_private_fedhm_are_refused_with_the_reason(capsys) -> None:
    privacy = '{"clip": 1.0, "noise_multiplier": 0.1}'
    assert main(["--strategies", "fedhm", "--attacks", "update_x-1,backdoor", "--privacy", privacy]) == 2
    assert "update_x-1 rewrite the factors a device was sent" in capsys.readouterr().err


def test_an_unknown_attack_is_named(capsys) -> None:
    assert main(["--attacks", "sign_flop"]) == 2
    assert "unknown attack 'sign_flop'" in capsys.readouterr().err
    assert "min_max" in ATTACKS and "little_is_enough" in ATTACKS and "label_flip" in ATTACKS
    assert "colluders_reversed" in ATTACKS and "at_the_cut" in ATTACKS and "under_the_floor" in ATTACKS


def test_the_backdoor_stamps_a_corner_square_on_half_a_shard_and_relabels_those() -> None:
    x, y = torch.rand(40, 1, 8, 8) * 0.5, torch.arange(40) % 10
    poisoned_x, poisoned_y = backdoored(x, y, seed=0)
    stamped = (poisoned_x[:, 0, -3:, -3:] == 1.0).all(dim=(1, 2))
    assert int(stamped.sum()) == 20 and (poisoned_y[stamped] == BACKDOOR_TARGET).all()
    assert torch.equal(poisoned_x[~stamped], x[~stamped]) and torch.equal(poisoned_y[~stamped], y[~stamped])
    assert (triggered(torch.zeros(1, 1, 28, 28))[0, 0] > 0).sum() == 100  # 10 x 10 on 28 x 28


def test_the_adaptive_attacker_sits_at_its_target_cosine_at_the_honest_norm() -> None:
    generator = torch.Generator().manual_seed(0)
    sent = {"w": torch.zeros(50)}
    common = torch.randn(50, generator=generator)
    honest = [{"w": common + 0.3 * torch.randn(50, generator=generator)} for _ in range(8)]
    upload = at_the_cut(Upload(sent, {"w": torch.randn(50, generator=generator)}, honest, target=-0.34))["w"]
    mean = torch.stack([h["w"] for h in honest]).mean(0)
    assert float(torch.nn.functional.cosine_similarity(upload, mean, dim=0)) == pytest.approx(-0.34, abs=1e-5)
    norms = torch.stack([h["w"] for h in honest]).norm(dim=1)
    assert float(upload.norm()) == pytest.approx(float(norms.mean()), rel=1e-5)


def test_the_adaptive_attacker_aims_inside_the_cut_the_gate_applies_this_round() -> None:
    generator = torch.Generator().manual_seed(3)
    common = torch.randn(4000, generator=generator)
    agreeing = {f"h{i}": sketch({"w": common + torch.randn(4000, generator=generator)}) for i in range(8)}
    noise = {f"h{i}": sketch({"w": torch.randn(4000, generator=generator)}) for i in range(8)}
    gate = GateSettings()
    cosines = list(peer_cosines(agreeing).values())
    median = statistics.median(cosines)
    deviation = 1.4826 * statistics.median(abs(c - median) for c in cosines)
    outlier = GateSettings(peer_outlier_deviations=4.0, peer_record_gap=None)
    outlier_cut = median - max(4.0 * deviation, outlier.peer_outlier_gap)
    assert outlier_cut > gate.peer_min_cosine  # type: ignore[operator]  # an agreeing round: above the floor
    assert cut_target(outlier, agreeing) == pytest.approx(outlier_cut + AT_THE_CUT_MARGIN)
    record = GateSettings(peer_outlier_deviations=None, peer_record_gap=0.2)
    assert cut_target(record, agreeing) == pytest.approx(median - 0.2 + AT_THE_CUT_MARGIN)  # a record kept inside
    floor_only = GateSettings(peer_outlier_deviations=None, peer_record_gap=None)
    assert cut_target(floor_only, agreeing) == pytest.approx(gate.peer_min_cosine + AT_THE_CUT_MARGIN)
    assert cut_target(gate, noise) == pytest.approx(gate.peer_hard_floor + AT_THE_CUT_MARGIN)  # no agreement
    every_round = GateSettings(peer_min_agreement=None, peer_record_gap=None)
    assert cut_target(every_round, noise) == pytest.approx(-0.19)  # the floor judges every round
    assert cut_target(GateSettings(peer_min_cosine=None), agreeing) == -1.0  # no peer check: anything passes


@pytest.mark.slow
def test_a_round_that_refused_its_attacker_is_not_failed() -> None:
    result = poisoning(["fedavg"], ["update_x-1"], [1], rounds=3, clients=5, train=TRAIN)
    [entry] = result["attacks"]
    assert entry["malicious_refused"] >= 1 and entry["honest_refused"] == 0  # the flipper was refused ...
    assert entry["failed_rounds"] == [] and result["failed_rounds_clean"] == {"fedavg": []}  # ... and no round failed


def test_a_backdoor_run_reports_its_success_on_triggered_images() -> None:
    result = poisoning(["fedavg"], ["backdoor"], [1], rounds=2, clients=5, train=TRAIN)
    [entry] = result["attacks"]
    assert 0 <= entry["attack_success"] <= 1 and result["backdoor_success_one_in_ten"] == entry["attack_success"]
    assert result["trigger_on_clean_model"]["fedavg"] < 0.5


def test_alpha_gives_the_clients_label_skewed_shards() -> None:
    data = load_dataset("digits", 8, 1)

    def top_share(client: SimClient) -> float:
        labels = client.train[1]
        return float(torch.bincount(labels).max()) / len(labels)

    iid = [top_share(c) for c in fleet_clients(data, 10, 0, None, (1.0,))]
    skewed = [top_share(c) for c in fleet_clients(data, 10, 0, None, (1.0,), alpha=0.1)]
    assert max(iid) < 0.25 and sum(skewed) / len(skewed) > 0.5  # iid: about a tenth each; Dirichlet(0.1): one class


def test_a_suite_reports_the_worst_of_its_cases_and_every_honest_refusal() -> None:
    cases = (Case("digits", None, ("fedavg",), ("update_x-1",)), Case("digits", 1.0, ("fedavg",), ("backdoor",)))
    result = suite(cases, rounds=2, clients=5, train=TRAIN)
    iid, skewed = result["cases"]
    assert (iid["case"], skewed["case"]) == ("digits iid fedavg: update_x-1", "digits dirichlet(1) fedavg: backdoor")
    assert skewed["settings"]["partition"] == "dirichlet(1)" and [e["malicious"] for e in iid["attacks"]] == [1, 2]
    assert result["worst_drop_two_in_ten"] == max(iid["worst_drop_two_in_ten"], skewed["worst_drop_two_in_ten"])
    assert result["backdoor_success_two_in_ten"] == skewed["backdoor_success_two_in_ten"] is not None
    assert result["honest_refused_attacked"] == sum(e["honest_refused"] for c in (iid, skewed) for e in c["attacks"])
    json.dumps(result)


def test_malicious_uploads_wait_for_the_honest_devices_assigned_the_round_only() -> None:
    holding = Holding()
    for device in ("c2", "c3"):
        holding.assigned(device, 5)  # c4, benched by the backoff, was not assigned round 5
    assert holding.hold(5, ("c0", "upload-0")) == []
    assert holding.answered("c2", 5) == []
    assert holding.answered("c3", 5) == [("c0", "upload-0")]  # every assigned honest device is in: released
    assert holding.hold(5, ("c1", "upload-1")) == [("c1", "upload-1")]  # a late attacker is not held
    holding.assigned("c2", 6)
    assert holding.hold(6, ("c0", "upload-6")) == []
    assert holding.release(6) == [("c0", "upload-6")] and holding.answered("c2", 6) == []  # the deadline's release
