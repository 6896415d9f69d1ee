"""A round nobody can take part in: said once, with the reason, and given up after the wait timeout."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from coordinator.engine import EngineSettings, RoundEngine
from coordinator.fleet import parse_fleet
from coordinator.local_link import InProcessLink, LocalDevice
from coordinator.planner import DevicePlan
from coordinator.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.data.datasets import LabeledData

FLEET = {
    "fleet": "waiting",
    "broker": {"mode": "managed"},
    "model": {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8},
    "dataset": {"name": "digits"},
    "ratios": [1],
    "devices": [{"id": "laptop-01", "profile": "rtx-4060-laptop"}],
}
TOO_SLOW = "excluded: round takes ~217 s > deadline 60 s"


def _nobody_fits(fleet, _catalog, _reports, _ceilings) -> list[DevicePlan]:
    return [DevicePlan(d.id, d.profile, None, None, None, None, None, 217.0, 60.0, TOO_SLOW) for d in fleet.devices]


def test_waiting_for_a_participant_is_logged_once_and_times_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = parse_fleet(FLEET)
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8))
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    x, y = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    engine = RoundEngine(
        fleet,
        {},
        strategy,
        rundir,
        LabeledData(x, y, x, y, 10),
        InProcessLink([LocalDevice("laptop-01", (x, y), (x, y))]),
        EngineSettings(min_devices=1, wait_timeout_s=1.5),
        planner=_nobody_fits,
    )
    caplog.set_level(logging.INFO, logger="fedfleet.engine")
    try:
        with pytest.raises(TimeoutError, match="round 1: no device could take part within 2 s"):
            engine.run()
    finally:
        rundir.close()

    waits = [r.getMessage() for r in caplog.records if "no online device can take part" in r.getMessage()]
    assert waits == [f"round 1: no online device can take part (laptop-01: {TOO_SLOW}); waiting up to 2 s"]
    assert sum("laptop-01 out" in r.getMessage() for r in caplog.records) == 1
