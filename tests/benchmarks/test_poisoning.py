"""benchmarks.poisoning at tiny settings: the JSON's shape, and -9.5x the weights contained by the defaults."""

import json

import pytest

from benchmarks.poisoning import ATTACKS, main, poisoning, table
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


def test_an_unknown_attack_is_named(capsys) -> None:
    assert main(["--attacks", "sign_flop"]) == 2
    assert "unknown attack 'sign_flop'" in capsys.readouterr().err
    assert "min_max" in ATTACKS and "little_is_enough" in ATTACKS and "label_flip" in ATTACKS
    assert "colluders_reversed" in ATTACKS
