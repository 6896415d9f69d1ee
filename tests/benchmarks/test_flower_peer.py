"""--peer flower gives Flower fedfleet's own task: the same clients, shards, model and local work."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from benchmarks.emulation import main
from benchmarks.flower_peer import ClientFactory, FlowerMissing, require_flower
from benchmarks.scale_fleet import DIGITS, scale_fleet
from benchmarks.scale_task import ScaleTask
from coordinator.config.fleet import parse_fleet
from coordinator.strategies.base import ClientSlot
from device_agent.training.local_round import train_assignment
from device_agent.wire.protocol import round_seed

FLOWER = importlib.util.find_spec("flwr") is not None and importlib.util.find_spec("ray") is not None
needs_flower = pytest.mark.skipif(not FLOWER, reason="flwr[simulation] not installed: pip install 'fedfleet[flower]'")


def test_without_flower_the_peer_exits_2_naming_the_extra(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "flwr", None)  # `import flwr` raises ImportError, installed or not
    with pytest.raises(FlowerMissing, match=r"fedfleet\[flower\]"):
        require_flower()
    assert main(["--scale", "--devices", "2", "--rounds", "1", "--peer", "flower", "--json"]) == 2
    captured = capsys.readouterr()
    assert "pip install 'fedfleet[flower]'" in captured.err and captured.out == ""  # no fleet was run


def test_the_fedavg_scale_fleet_trains_the_full_model_on_every_class() -> None:
    fleet = parse_fleet(scale_fleet(6, 18999, strategy="fedavg", rounds=2), source="scale")
    assert fleet.strategy.name == "fedavg" and fleet.rounds == 2
    assert [d.profile for d in fleet.devices[:3]] == ["jetson-orin-nano-8gb", "raspberry-pi-5", "raspberry-pi-4"]
    assert all(d.overrides.max_ratio is None for d in fleet.devices)


@needs_flower
def test_the_flower_client_trains_what_a_fedfleet_device_trains() -> None:
    factory = ClientFactory(devices=3, data=DIGITS, rounds=1, deadline_s=None)
    task = ScaleTask.build(3, DIGITS, rounds=1)
    start = task.global_arrays()
    trainable = task.strategy.trainable()
    updates = []
    for index in range(3):
        arrays, samples, _ = factory.numpy_client(index).fit(start, {"round": 1})
        assert [a.shape for a in arrays] == [tuple(trainable[k].shape) for k in task.trainable]
        assert samples == len(task.shard(index)[0][1]) > 0
        # fedfleet's own round for this device: its FedAvg assignment, its training settings and seed
        assignment = task.strategy.configure(1, [ClientSlot(f"d{index}", 1.0, samples)])[f"d{index}"]
        # the coordinator deals seeds by the run seed (the data set's) and the device's place among sorted ids
        place = sorted(d.id for d in task.fleet.devices).index(task.fleet.devices[index].id)
        train = task.fleet.training.for_device(task.fleet.devices[index], round_seed(task.fleet.dataset.seed, 1, place))
        expected = train_assignment(assignment.spec, train, assignment.tensors, None, *task.shard(index)).upload
        for key, array in zip(task.trainable, arrays, strict=True):
            torch.testing.assert_close(torch.from_numpy(array), expected[key])
        assert not np.array_equal(arrays[0], start[task.keys.index(task.trainable[0])])  # it trained
        updates.append((arrays, samples))
    total = sum(samples for _, samples in updates)
    averaged = [sum(arrays[i] * samples for arrays, samples in updates) / total for i in range(len(trainable))]
    following, accuracy = task.close_round(averaged)
    assert [a.shape for a in following] == [a.shape for a in start] and accuracy > 0.5  # ten classes: chance 0.1


def test_with_the_flower_peer_each_size_alternates_the_engines_abba_and_reports_the_ratio_and_spread(
    monkeypatch,
) -> None:
    from benchmarks import emulation_scale, flower_peer, scale_task

    asked: list[tuple[str, int]] = []
    fedfleet_rounds, flower_rounds = iter([3.0, 3.3, 3.0, 3.6]), iter([4.0, 3.0, 4.0, 4.0])

    def fleet_run(devices: int, **options: object) -> dict:
        assert options["strategy"] == "fedavg"
        asked.append(("fedfleet", devices))
        return {"devices": devices, "completed": True, "median_round_seconds": next(fedfleet_rounds)}

    def flower_run(devices: int, *args: object) -> dict:
        asked.append(("flower", devices))
        return {"completed": True, "median_round_seconds": next(flower_rounds)}

    monkeypatch.setattr(emulation_scale, "run_size", fleet_run)
    monkeypatch.setattr(scale_task.ScaleTask, "build", classmethod(lambda cls, *args: None))
    monkeypatch.setattr(scale_task, "compute_floor", lambda task: {"compute_floor_seconds": 0.5})
    monkeypatch.setattr(flower_peer, "run_size", flower_run)
    outcome = emulation_scale.scale([20, 10], rounds=2, peer="flower", pairs=2)
    a_b_b_a = [("fedfleet", 10), ("flower", 10), ("flower", 10), ("fedfleet", 10)]
    assert asked == [*a_b_b_a, ("fedfleet", 20), ("flower", 20), ("flower", 20), ("fedfleet", 20)]
    assert outcome["strategy"] == "fedavg" and outcome["max_devices"] == 20
    # Pair ratios 3.0/4.0 and 3.3/3.0 at 10 devices, 3.0/4.0 and 3.6/4.0 at 20: the median and the extremes.
    assert outcome["ratio_vs_flower_10"] == 0.925 and outcome["spread_vs_flower_10"] == [0.75, 1.1]
    assert outcome["ratio_vs_flower_20"] == 0.825 and outcome["spread_vs_flower_20"] == [0.75, 0.9]
    first = outcome["runs"][0]
    assert [pair["order"] for pair in first["pairs"]] == [["fedfleet", "flower"], ["flower", "fedfleet"]]
    assert first["flower"]["median_round_seconds"] == 4.0 and first["compute_floor_seconds"] == 0.5


def test_both_engines_trees_start_on_one_thread_per_process() -> None:
    from benchmarks.emulation_scale import PINNED_THREADS

    assert PINNED_THREADS == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
