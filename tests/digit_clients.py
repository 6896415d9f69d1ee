"""Simulated devices on an iid split of scikit-learn's digits (8x8, one channel), for engine-level tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import SimClient, fixed_levels
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import Strategy
from coordinator.transport.link import Link
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard


def digit_clients(names: Sequence[str], levels: Sequence[float] | None = None) -> list[SimClient]:
    """One client per name, each holding shard i of an iid split (seed 0) of the train and test sets."""
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", len(names), seed=0)
    return [
        SimClient(
            name,
            1.0 if levels is None else levels[i],
            client_shard(data.train_x, data.train_y, spec, i),
            client_shard(data.test_x, data.test_y, spec, i),
        )
        for i, name in enumerate(names)
    ]


def digit_engine(
    tmp_path: Path,
    raw: Mapping[str, Any],
    strategy: Strategy,
    link: Link,
    levels: Mapping[str, float],
    settings: EngineSettings,
) -> RoundEngine:
    """A RoundEngine over ``link`` with its fleet.yaml and run dir in ``tmp_path`` and 128 digits to calibrate."""
    data = load_dataset("digits", 8, 1)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(dict(raw)))
    calibration = data.train_x[:128]
    return RoundEngine(
        parse_fleet(dict(raw)),
        {},
        strategy,
        RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0),
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        link,
        settings,
        planner=fixed_levels(dict(levels)),
    )
