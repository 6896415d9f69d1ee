"""One device cannot hold every round to its deadline: a silent one and a refused one are cut after a grace
tied to the round's answer times, and a device that keeps missing rounds sits out some (backoff)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.observe.prometheus import RunCollector
from coordinator.observe.snapshot import FleetWatch
from coordinator.rounds.backoff import Backoff
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.rounds.laggards import LaggardGrace
from coordinator.rounds.state import OpenRound, Participant
from coordinator.run.report import write_report
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.wire.messages import Assignment, Message
from device_agent.wire.payload import Received
from tests.coordinator.rounds.uploads import with_nan
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)
DEADLINE_S = 60


class SilentLink(MemoryLink):
    """Device ``c`` said ``idle`` once (the link's start does, as a retained status would) and is silent since:
    its assignments go nowhere."""

    def send_control(self, device: str, message: Message) -> None:
        if not (device == "c" and isinstance(message, Assignment)):
            super().send_control(device, message)


class RefusedLink(MemoryLink):
    """Every upload of ``c`` arrives non-finite, so the gate refuses it; ``c``'s agent then says idle."""

    def start(self, on_message, on_payload, on_refused=None) -> None:
        def intercept(device: str, received: Received) -> None:
            if device == "c":
                received = with_nan(received)
            on_payload(device, received)

        super().start(on_message, intercept)


def run_fleet(tmp_path: Path, link_type: type[MemoryLink], rounds: int, grace_min_s: float) -> RoundEngine:
    """FedAvg rounds of devices a, b, c on digits: a 60 s deadline, quorum 2 of 3, backoff after 2 misses."""
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["a", "b", "c"])
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    fleet_file = tmp_path / "fleet.yaml"
    raw = simulation_fleet(strategy, clients, rounds, TrainConfig(batch_size=32), limits={"backoff_after": 2})
    fleet_file.write_text(yaml.safe_dump(raw | {"round_deadline_s": DEADLINE_S, "quorum": 0.6}))
    calibration = data.train_x[:128]
    engine = RoundEngine(
        parse_fleet(yaml.safe_load(fleet_file.read_text())),
        {},
        strategy,
        RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0),
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        link_type([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
        EngineSettings(
            min_devices=3, wait_timeout_s=30, resend_after_s=0.2, rejected_grace_s=30, laggard_grace_min_s=grace_min_s
        ),
        planner=fixed_levels({"a": 1.0, "b": 1.0, "c": 1.0}),
    )
    assert engine.run()
    return engine


@pytest.mark.slow
def test_a_silent_device_is_cut_after_the_grace_and_sits_out_after_missing_rounds_in_a_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fedfleet.engine"):
        engine = run_fleet(tmp_path, SilentLink, rounds=4, grace_min_s=2.0)
    rounds = engine.rundir.metrics()
    assert [{d: m.status for d, m in r.devices.items()} for r in rounds] == [
        {"a": "accepted", "b": "accepted", "c": "late"},
        {"a": "accepted", "b": "accepted", "c": "late"},
        {"a": "accepted", "b": "accepted"},  # c sits out round 3 after missing 2 in a row
        {"a": "accepted", "b": "accepted", "c": "late"},
    ]
    assert all(r.seconds < 15 for r in rounds), [r.seconds for r in rounds]  # not the 60 s deadline
    assert (engine.backoff.missed["c"], engine.backoff.backoffs["c"]) == (3, 2)
    assert "c missed 2 rounds in a row (round 2: late); it sits out round 3" in caplog.text
    assert "c missed 3 rounds in a row (round 4: late); it sits out rounds 5-6" in caplog.text
    assert "round 3: a at 1; b at 1; c out (backing off)" in caplog.text
    # Counted and reported: the status page's snapshot, the Prometheus gauge, and a resumed engine's count.
    watch = FleetWatch([])
    watch.update(engine)
    c = next(d for d in watch.snapshot.devices if d.id == "c")
    assert (c.missed_in_a_row, c.backoffs, c.sits_out_until) == (3, 2, 6)
    families = RunCollector(lambda: watch.snapshot).collect()
    missed = next(f for f in families if f.name == "fedfleet_device_missed_rounds")
    assert {sample.labels["device"]: sample.value for sample in missed.samples} == {"a": 0, "b": 0, "c": 3}
    devices = write_report(engine.rundir.path).read_text().split("<h2>Devices</h2>")[1].split("</table>")[0]
    assert "<th>most missed in a row</th>" in devices
    assert re.search(r"<tr><td>c</td>((?!</tr>).)*<td>3</td></tr>", devices)  # rounds 1, 2 and 4: it sat out round 3
    rebuilt = Backoff(2, 16, rounds)
    assert (rebuilt.missed, rebuilt.until) == (engine.backoff.missed, engine.backoff.until)


@pytest.mark.slow
def test_a_device_the_gate_refuses_every_time_does_not_hold_the_round_to_its_refusal_grace(tmp_path: Path) -> None:
    engine = run_fleet(tmp_path, RefusedLink, rounds=1, grace_min_s=5.0)
    (closed,) = engine.rundir.metrics()
    assert {d: (m.status, m.reason) for d, m in closed.devices.items()} == {
        "a": ("accepted", None),
        "b": ("accepted", None),
        "c": ("rejected", "non_finite"),
    }
    assert engine.refusals == {("c", "non_finite"): 2}  # refused, sent its assignment again, refused again
    assert closed.seconds < 15  # not 30 s after its last refusal (rejected_grace_s), nor the 60 s deadline


def test_the_grace_follows_the_rounds_answer_times_and_a_device_planned_slower_gets_its_planned_time() -> None:
    open_ = OpenRound(1, {d: Participant(1.0) for d in ("a", "b", "c", "slow")}, None, 100.0, 0.0)  # type: ignore[arg-type]
    open_.pushed = 0.0
    for device, t in {"a": 2.0, "b": 4.0, "c": 3.0}.items():
        open_.participants[device].status, open_.participants[device].answered_at = "accepted", t
    grace = LaggardGrace(factor=3.0, floor_s=1.0)
    graces = grace.graces(open_, {"a": 1.0, "b": 2.0, "c": 1.5, "slow": 10.0})  # answers took 2x their plans
    assert graces == {"a": 9.0, "b": 12.0, "c": 9.0, "slow": 60.0}  # 3 x max(median 3 s, 2 x planned)
    assert not grace.past(open_, quorum=3, now=59.0, estimates={"slow": 10.0, "a": 1.0, "b": 2.0, "c": 1.5})
    assert grace.past(open_, quorum=3, now=61.0, estimates={"slow": 10.0, "a": 1.0, "b": 2.0, "c": 1.5})
    assert not grace.past(open_, quorum=4, now=99.0, estimates={})  # below its quorum: the quorum rule decides
    assert LaggardGrace(3.0, floor_s=10.0).graces(open_, {})["slow"] == 10.0
