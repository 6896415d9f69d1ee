"""``on_quorum_miss: retry`` under secure aggregation: the protocol runs again with fresh keys, before any unmasking.

Five real agents over the in-memory transport, quorum 1.0, one retry: c4's training fails (labels past the
classes), so four masked inputs come in, below the quorum of five. Instead of unmasking those four, the engine
opens a new attempt of the protocol among the four still there; each masks the update it kept (no device trains
twice), and only then is a sum unmasked. Unmasking the four first and a larger set later would hand the
coordinator the difference of two sums: one device's update when the second set has one device more.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.screening import OFF
from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import SimClient, fixed_levels, simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice
from coordinator.transport.registry import transport_of
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig


@pytest.mark.slow
def test_a_round_below_its_quorum_reruns_the_protocol_with_fresh_keys_before_unmasking(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", 5, seed=0)
    shards = [client_shard(data.train_x, data.train_y, spec, i) for i in range(5)]
    clients = [SimClient(f"c{i}", 1.0, shard, shards[0]) for i, shard in enumerate(shards)]
    x, y = clients[4].train
    clients[4] = SimClient("c4", 1.0, (x, torch.full_like(y, 99)), shards[0])  # its training fails
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    raw = simulation_fleet(
        strategy, clients, 1, TrainConfig(epochs=1, seed=0), limits=OFF, secure_aggregation=SECURE
    ) | {"on_quorum_miss": "retry", "quorum_retries": 1, "round_deadline_s": 120}
    fleet = parse_fleet(raw, source="test")
    link = transport_of(fleet).simulation_link(fleet, [LocalDevice(c.client_id, c.train, c.test) for c in clients])
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(raw))
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    calibration = data.train_x[:128]
    engine = RoundEngine(
        fleet,
        {},
        strategy,
        rundir,
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        link,
        EngineSettings(min_devices=5, wait_timeout_s=60, rejected_grace_s=0.0),
        planner=fixed_levels(dict.fromkeys([c.client_id for c in clients], 1.0)),
    )
    sessions = []
    with caplog.at_level(logging.INFO):
        try:
            engine.run(lambda running: running.secure and sessions.append(running.secure.session))
            (metrics,) = rundir.metrics()
        finally:
            rundir.close()

    retry = "4 masked inputs, below the quorum of 5; secure aggregation again with fresh keys among 4 devices"
    assert any(retry in r.getMessage() and "(retry 1 of 1)" in r.getMessage() for r in caplog.records)
    attempts = sorted({s.attempt for s in sessions})
    assert len(attempts) == 2 and {s.round for s in sessions} == {1}
    # Only the second attempt was unmasked (one sum, of the four); each device trained once.
    sums = [r.getMessage() for r in caplog.records if "secure sum of" in r.getMessage()]
    assert sums == ["round 1: secure sum of 4 updates (0 dropped), at most 3.05e-05 off the exact sum per value"]
    trainings = [r.getMessage().split(":")[0] for r in caplog.records if "round 1: training at level" in r.getMessage()]
    assert sorted(trainings) == ["c0", "c1", "c2", "c3", "c4"]
    assert metrics.devices["c4"].status == "failed" and metrics.participants == 4  # still below the quorum


SECURE = {"threshold": 3, "neighbours": 4, "clip": 0.5, "bits": 16}
