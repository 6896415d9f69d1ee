"""benchmarks.async: the fleet it plans is heterogeneous enough, and a tiny run reports every mode on the clock.

The module is named ``async``, a keyword: imported with importlib.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.fleet_clock import planned_devices, speed_spread
from device_agent.data.datasets import FASHION_MNIST_DIR
from profiles.catalog import load_catalog

bench = importlib.import_module("benchmarks.async")


def test_the_fleet_spans_three_classes_and_more_than_ten_times_in_device_seconds() -> None:
    catalog = load_catalog()
    profiles = {f"{c}-{i}": c for i, c in enumerate(bench.CLASSES)}
    shards = dict.fromkeys(profiles, 100)
    splits = {d: (torch.zeros(100, 1, 14, 14), torch.zeros(100, dtype=torch.long)) for d in profiles}
    fedavg = planned_devices(parse_fleet(bench.fleet_yaml("fedavg", shards, profiles, 2.0), catalog), catalog, splits)
    assert len(bench.CLASSES) == 3 and speed_spread(fedavg) >= 10
    fedhm = planned_devices(parse_fleet(bench.fleet_yaml("fedhm", shards, profiles, 0.3), catalog), catalog, splits)
    levels = {profiles[d.device]: d.level for d in fedhm}
    assert levels["jetson-orin-nano-8gb"] == 1 and levels["raspberry-pi-4"] < 1  # the planner shrinks the slow one


def test_the_summary_keeps_a_mode_that_missed_the_target_without_a_mean_time() -> None:
    seeds = [
        {
            "time_to_target_s": {"sync_fedhm": 10.0, "async_fedhm": 4.0, "async_fedavg": t},
            "accuracy_at_same_time": {"sync_fedhm": 0.5, "async_fedhm": 0.7, "async_fedavg": 0.6},
            "speedup": 2.5,
        }
        for t in (5.0, None)
    ]
    summary = bench.summarize(seeds)
    assert summary["async_fedhm"] == {"time_to_target_s": 4.0, "reached": 2, "accuracy_at_same_time": 0.7}
    assert summary["async_fedavg"]["time_to_target_s"] is None and summary["async_fedavg"]["reached"] == 1
    assert summary["speedup_async_fedhm_over_sync_fedhm"] == {"per_seed": [2.5, 2.5], "mean": 2.5, "min": 2.5}


@pytest.mark.skipif(not FASHION_MNIST_DIR.exists(), reason="Fashion-MNIST is not installed (dataset-fashion-mnist)")
def test_a_tiny_run_reports_time_to_target_and_accuracy_at_the_same_time_for_every_mode(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        args = ["--json", "--seeds", "1", "--per-class", "1", "--train-samples", "150", "--test-samples", "100"]
        assert bench.main([*args, "--target", "0.2", "--max-seconds", "3", "--buffer", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out)
    seed = result["per_seed"][0]
    assert set(seed["time_to_target_s"]) == set(bench.MODES) == set(seed["accuracy_at_same_time"])
    assert seed["same_time_s"] <= 3 and result["provenance"]["torch"] and result["seeds"] == 1
    assert result["goal_met"] == (result["speedup_min"] is not None and result["speedup_min"] >= 2)
    assert all(sum(h.values()) == seed["updates"][m] for m, h in seed["staleness"].items())
