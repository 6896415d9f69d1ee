"""A coordinator with no data: the round engine runs on the devices' federated evaluation alone.

The engine runs in-process (:class:`MemoryLink`, as ``simulate`` does) with fleet.yaml
``evaluation: {server: false}`` and no test split of its own; each round's figure is what the
devices measured for the model they received.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import SimClient, fixed_levels, simulate, simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.metrics import round_scores
from coordinator.run.report import write_report
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)
NO_DATA = torch.empty(0, 1, 8, 8)
NO_LABELS = torch.empty(0, dtype=torch.long)


@pytest.fixture(scope="module")
def clients() -> list[SimClient]:
    return digit_clients(["pi-0", "pi-1"])


class SilentLink(MemoryLink):
    """Device ``pi-1`` trains but its update never arrives (the coordinator stops before it would)."""

    def start(self, on_message, on_payload, on_refused=None) -> None:
        super().start(
            on_message, lambda device, completed: device != "pi-1" and on_payload(device, completed), on_refused
        )


def engine_without_server_data(
    clients: list[SimClient], run_dir: Path, rounds: int, link: type[MemoryLink] = MemoryLink
) -> RoundEngine:
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, rounds, TrainConfig(batch_size=32), server_evaluation=False)
    fleet_file = run_dir.parent / "fleet.yaml"
    if (run_dir / "run.json").exists():
        rundir = RunDir.open(run_dir, fleet_file)
    else:
        fleet_file.write_text(yaml.safe_dump(raw))
        rundir = RunDir.create(
            run_dir, fleet_file, strategy.state_dict(), seed=0, retention=parse_fleet(raw).checkpoints
        )
    empty = LabeledData(NO_DATA, NO_LABELS, NO_DATA, NO_LABELS, 10)
    return RoundEngine(
        parse_fleet(raw, source="test"),
        {},
        strategy,
        rundir,
        empty,
        link([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
        EngineSettings(min_devices=len(clients), wait_timeout_s=60),
        planner=fixed_levels({c.client_id: c.level for c in clients}),
    )


def run_without_server_data(clients: list[SimClient], run_dir: Path, rounds: int) -> RunDir:
    engine = engine_without_server_data(clients, run_dir, rounds)
    assert engine.run()
    return engine.rundir


@pytest.mark.slow
def test_rounds_close_on_federated_evaluation_alone_and_the_report_shows_it(clients, tmp_path) -> None:
    rundir = run_without_server_data(clients, tmp_path / "run", rounds=3)
    try:
        metrics = rundir.metrics()
        kept = sorted(int(p.stem.split("-")[-1]) for p in rundir.path.glob("**/round-*.safetensors"))
    finally:
        rundir.close()

    assert [m.round for m in metrics] == [1, 2, 3]
    assert all(m.accuracy is None and m.loss is None for m in metrics)
    for m in metrics:
        reports = [d for d in m.devices.values() if d.status == "accepted"]
        assert {d.eval_samples for d in reports} == {len(c.test[1]) for c in clients}
        weighted = sum(d.global_accuracy * d.eval_samples for d in reports) / sum(d.eval_samples for d in reports)
        assert m.federated_accuracy == pytest.approx(weighted)
        assert m.federated_loss is not None and m.federated_loss > 0
    # Round 1 measures the untrained initial model; round 3 the model after two rounds of training.
    assert metrics[0].federated_accuracy < 0.3 < 0.7 < metrics[2].federated_accuracy
    assert round_scores(metrics) == {m.round: m.personalized_accuracy for m in metrics}
    assert 3 in kept  # pruning ran without a server accuracy

    page = write_report(tmp_path / "run").read_text()
    assert "final federated accuracy (model received)" in page
    assert f"{metrics[-1].federated_accuracy:.4f}" in page
    assert "final accuracy" not in page


def stop_once_one_is_in(engine: RoundEngine) -> None:
    if engine.open is not None and engine.open.accepted:
        engine.stop()


@pytest.mark.slow
def test_a_resumed_round_keeps_the_federated_figures_of_its_journaled_uploads(clients, tmp_path, caplog) -> None:
    first = engine_without_server_data(clients, tmp_path / "run", rounds=1, link=SilentLink)
    assert not first.run(stop_once_one_is_in)
    first.rundir.close()

    resumed = engine_without_server_data(clients, tmp_path / "run", rounds=1)
    with caplog.at_level(logging.INFO, logger="fedfleet.engine"):
        assert resumed.run()
    try:
        (metrics,) = resumed.rundir.metrics()
    finally:
        resumed.rundir.close()

    assert "round 1: replayed pi-0's journaled update" in caplog.messages
    replayed, fresh = metrics.devices["pi-0"], metrics.devices["pi-1"]
    assert replayed.status == fresh.status == "accepted"
    assert replayed.eval_samples == len(clients[0].test[1]) and replayed.global_accuracy is not None
    total = replayed.eval_samples + fresh.eval_samples
    weighted = (replayed.global_accuracy * replayed.eval_samples + fresh.global_accuracy * fresh.eval_samples) / total
    assert metrics.federated_accuracy == pytest.approx(weighted)


def test_a_simulation_can_run_as_a_coordinator_without_data(clients) -> None:
    strategy = build_strategy("fedhm", CNN, {}, seed=0)
    result = simulate(
        strategy, clients, 1, TrainConfig(batch_size=32), (NO_DATA, NO_LABELS), NO_DATA, server_evaluation=False
    )

    assert result.final.accuracy is None
    assert result.final.federated_accuracy is not None and 0 <= result.final.federated_accuracy <= 1
