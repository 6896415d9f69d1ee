"""Rounds and FedBuff on the fleet's clock: device seconds from the plan, real training, time to accuracy."""

from __future__ import annotations

import pytest
import torch

from coordinator.config.asynchronous import AsyncSettings
from coordinator.config.fleet import parse_fleet
from coordinator.emulation.fleet_clock import ClockDevice, ClockRun, Point, planned_devices, run_async, run_sync
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, capped, client_shard
from profiles.catalog import load_catalog

SPEC = ModelSpec("cnn", 10, 1, 8)
TRAIN = TrainConfig(lr=0.05, epochs=1, batch_size=32, seed=0)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the benchmark runs: on a shared 2-core host two threads spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", 4, 0)
    shards = [capped(client_shard(data.train_x, data.train_y, spec, i), 96, 0) for i in range(4)]  # 3 steps each
    return data, shards


def fleet_of(digits, seconds: list[float], level: float = 1.0) -> list[ClockDevice]:
    _, shards = digits
    return [ClockDevice(f"d{i}", level, s, shards[i]) for i, s in enumerate(seconds)]


def test_a_sync_round_lasts_as_long_as_its_slowest_device(digits) -> None:
    data, _ = digits
    devices = fleet_of(digits, [1.0, 1.0, 1.0, 10.0])
    run = run_sync(
        build_strategy("fedavg", SPEC, seed=0), devices, TRAIN, (data.test_x, data.test_y), data.train_x[:256], 25.0
    )
    assert [p.seconds for p in run.points] == [0.0, 10.0, 20.0, 30.0]
    assert [p.updates for p in run.points] == [0, 4, 8, 12]
    assert run.points[-1].accuracy > run.points[0].accuracy


def test_async_devices_answer_at_their_own_pace_and_a_version_is_published_every_k_updates(digits) -> None:
    data, _ = digits
    devices = fleet_of(digits, [1.0, 1.0, 1.0, 10.0])
    settings = AsyncSettings(buffer=3, max_staleness=20)
    strategy = build_strategy("fedavg", SPEC, seed=0)
    run = run_async(strategy, settings, devices, TRAIN, (data.test_x, data.test_y), data.train_x[:256], 10.5)
    # By 10.5 s the fast devices answered 10 times each and the slow one once (at 10 s, first of that instant): 31
    # updates; the 10th version, published at the 30th, is the last.
    assert run.points[-1].updates == 30 and run.points[-1].version == 10 == len(run.updates_per_version)
    assert run.folded == 31 == sum(run.staleness.values())
    assert set(run.updates_per_version.values()) == {3}
    assert run.points[1].seconds == 1.0  # the first three updates arrive together at 1 s
    assert run.staleness[9] == 1  # the slow device trained on version 0 and came back when version 9 was out
    assert run.points[-1].accuracy > run.points[0].accuracy


def test_an_update_past_max_staleness_is_lost_and_counted(digits) -> None:
    data, _ = digits
    devices = fleet_of(digits, [1.0, 1.0, 1.0, 10.0])
    settings = AsyncSettings(buffer=3, max_staleness=2)
    strategy = build_strategy("fedavg", SPEC, seed=0)
    run = run_async(strategy, settings, devices, TRAIN, (data.test_x, data.test_y), data.train_x[:256], 10.5)
    assert run.refused == {"too_stale": 1} and max(run.staleness) <= 2


def test_time_to_accuracy_is_the_first_time_the_global_model_reached_it() -> None:
    run = ClockRun(
        "sync", [Point(0.0, 0.1, 0, 0), Point(2.0, 0.55, 1, 4), Point(4.0, 0.5, 2, 8), Point(6.0, 0.7, 3, 12)]
    )
    assert run.time_to_accuracy(0.5) == 2.0 and run.time_to_accuracy(0.7) == 6.0
    assert run.time_to_accuracy(0.9) is None
    assert run.accuracy_at(5.9) == 0.5 and run.accuracy_at(1.0) == 0.1 and run.best == 0.7


def test_planned_devices_take_the_planners_level_and_seconds(digits) -> None:
    _, shards = digits
    devices = [
        {"id": f"d{i}", "profile": p, "overrides": {"samples": len(shards[i][1])}}
        for i, p in enumerate(["jetson-orin-nano-8gb", "raspberry-pi-4"])
    ]
    fleet = parse_fleet(
        {
            "fleet": "clock",
            "transport": {"broker": {"mode": "managed"}},
            "model": {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8},
            "strategy": {"name": "fedhm"},
            "devices": devices,
        },
        load_catalog(),
    )
    planned = planned_devices(fleet, load_catalog(), {f"d{i}": shards[i] for i in range(2)})
    assert [d.device for d in planned] == ["d0", "d1"]
    assert planned[1].seconds > 5 * planned[0].seconds  # a Pi 4 is far slower than an Orin Nano
    assert torch.equal(planned[1].train[1], shards[1][1])
