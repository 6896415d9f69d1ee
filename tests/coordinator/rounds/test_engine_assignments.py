"""A participant without an accepted update gets its assignment again when it says it is idle, and still trains."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients import PROGRAMS
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.messages import Assignment, Manifest, Message, Status
from device_agent.wire.payload import Received
from tests.coordinator.rounds.uploads import with_nan
from tests.digit_clients import digit_clients
from tests.program_bugs import BUG, with_first_upload_bug

CNN = ModelSpec("cnn", 10, 1, 8)


class RecordingLink(MemoryLink):
    """Records to whom each assignment went."""

    def __init__(self, devices: list[LocalDevice]) -> None:
        super().__init__(devices)
        self.assignments: list[str] = []

    def send_control(self, device: str, message: Message) -> None:
        if isinstance(message, Assignment):
            self.assignments.append(device)
        super().send_control(device, message)


class LossyLink(RecordingLink):
    """Loses device ``b``'s first assignment; ``b`` then reports idle, as an agent's heartbeat does."""

    idle_after_s = 0.5

    def send_control(self, device: str, message: Message) -> None:
        if isinstance(message, Assignment) and device == "b" and "b" not in self.assignments:
            self.assignments.append(device)
            idle = Status(device="b", state="idle")
            threading.Timer(self.idle_after_s, lambda: self.hub.to_coordinator("b", idle)).start()
            return
        super().send_control(device, message)


class EarlyIdleLink(LossyLink):
    """``b`` says idle once, too soon after its lost assignment to tell a lost one from a slow one.

    A device whose login another connection took over reconnects and says idle within a second; its next
    heartbeat may come after the round closed.
    """

    idle_after_s = 0.05


class JustDeliveredLink(LossyLink):
    """``b`` acks its model just as it reports idle (a report sent before the model arrived, read late by a busy
    coordinator): that report is stale. Its heartbeat 1.5 s later, past ``resend_after_s``, is not."""

    idle_after_s = 1.2

    def __init__(self, devices: list[LocalDevice]) -> None:
        super().__init__(devices)
        self.sent_at: list[float] = []
        self.b_delivered: float | None = None

    def send_control(self, device: str, message: Message) -> None:
        if isinstance(message, Assignment) and device == "b" and "b" not in self.assignments:
            heartbeat = Status(device="b", state="idle")
            threading.Timer(self.idle_after_s + 1.5, lambda: self.hub.to_coordinator("b", heartbeat)).start()
        self._record_and_send(device, message)

    def _record_and_send(self, device: str, message: Message) -> None:
        if isinstance(message, Assignment) and device == "b":
            self.sent_at.append(time.monotonic())
            if len(self.sent_at) == 1:
                self.b_delivered = time.monotonic() + self.idle_after_s
        super().send_control(device, message)

    def delivered_ago(self, device: str) -> float | None:
        if device != "b" or self.b_delivered is None:
            return None
        return max(0.0, time.monotonic() - self.b_delivered)


class RefusedOnceLink(RecordingLink):
    """Device ``b``'s first upload is corrupted on the way (NaN); its agent, refused, then reports idle."""

    def __init__(self, devices: list[LocalDevice]) -> None:
        super().__init__(devices)
        self.uploads: list[str] = []

    def start(self, on_message, on_payload, on_refused=None) -> None:
        def intercept(device: str, received: Received) -> None:
            self.uploads.append(device)
            if device == "b" and self.uploads.count("b") == 1:
                received = with_nan(received)
            on_payload(device, received)

        super().start(on_message, intercept)


class TooLargeLink(RecordingLink):
    """Every upload of ``b`` is refused by the transport (past ``limits.max_upload_bytes``); ``b`` then says idle."""

    def start(self, on_message, on_payload, on_refused=None) -> None:
        def intercept(device: str, received: Received) -> None:
            if device != "b":
                on_payload(device, received)
                return
            on_refused("b", "transfer_refused")
            threading.Timer(0.1, lambda: self.hub.to_coordinator("b", Status(device="b", state="idle"))).start()

        super().start(on_message, intercept)


class BadAssignmentOnceLink(MemoryLink):
    """Device ``b``'s first assignment arrives with one tensor in float64, as a buggy strategy might send it."""

    def __init__(self, devices: list[LocalDevice]) -> None:
        super().__init__(devices)
        self.payloads: list[str] = []

    def send_payload(self, device: str, payload: bytes, manifest: Manifest) -> str:
        self.payloads.append(device)
        if device == "b" and self.payloads.count("b") == 1:
            tensors = decode_tensors(payload)
            payload = encode_tensors({**tensors, "fc.weight": tensors["fc.weight"].double()})
        return super().send_payload(device, payload, manifest)


def run_round(
    tmp_path: Path,
    link_type: type[MemoryLink],
    resend_after_s: float = 0.2,
    rejected_grace_s: float = 10.0,
    rounds: int = 1,
) -> tuple[RoundEngine, MemoryLink]:
    """FedAvg rounds (one by default) of devices a and b on digits, with a 20 s deadline."""
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["a", "b"])
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    fleet_file = tmp_path / "fleet.yaml"
    raw = simulation_fleet(strategy, clients, rounds, TrainConfig(batch_size=32)) | {"round_deadline_s": 20}
    fleet_file.write_text(yaml.safe_dump(raw))  # without a re-send, b would be "late" or "rejected" after 20 s
    link = link_type([LocalDevice(c.client_id, c.train, c.test) for c in clients])
    calibration = data.train_x[:128]
    engine = RoundEngine(
        parse_fleet(yaml.safe_load(fleet_file.read_text())),
        {},
        strategy,
        RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0),
        LabeledData(calibration, calibration.new_zeros(128), data.test_x, data.test_y, 10),
        link,
        EngineSettings(
            min_devices=2, wait_timeout_s=30, resend_after_s=resend_after_s, rejected_grace_s=rejected_grace_s
        ),
        planner=fixed_levels({"a": 1.0, "b": 1.0}),
    )
    assert engine.run()
    return engine, link


@pytest.mark.slow
def test_a_device_idle_mid_round_gets_its_assignment_again_and_is_accepted(tmp_path: Path) -> None:
    engine, link = run_round(tmp_path, LossyLink)
    assert sorted(link.assignments) == ["a", "b", "b"]
    assert {d: m.status for d, m in engine.last.devices.items()} == {"a": "accepted", "b": "accepted"}


@pytest.mark.slow
def test_an_idle_report_too_soon_after_the_assignment_still_gets_it_sent_again_once_due(tmp_path: Path) -> None:
    engine, link = run_round(tmp_path, EarlyIdleLink, resend_after_s=1.0)
    assert sorted(link.assignments) == ["a", "b", "b"]
    assert {d: m.status for d, m in engine.last.devices.items()} == {"a": "accepted", "b": "accepted"}


@pytest.mark.slow
def test_an_idle_report_read_just_after_the_model_arrived_waits_before_the_assignment_goes_again(
    tmp_path: Path,
) -> None:
    engine, link = run_round(tmp_path, JustDeliveredLink, resend_after_s=1.0)
    first, again = link.sent_at
    assert again - first >= JustDeliveredLink.idle_after_s + 1.4  # not on the stale report: on the heartbeat
    assert {d: m.status for d, m in engine.last.devices.items()} == {"a": "accepted", "b": "accepted"}


@pytest.mark.slow
def test_a_refused_device_is_sent_its_assignment_again_once_and_its_genuine_update_counts(tmp_path: Path) -> None:
    engine, link = run_round(tmp_path, RefusedOnceLink)
    assert sorted(link.assignments) == ["a", "b", "b"] and sorted(link.uploads) == ["a", "b", "b"]
    assert engine.refusals == {("b", "non_finite"): 1}
    assert {d: m.status for d, m in engine.last.devices.items()} == {"a": "accepted", "b": "accepted"}
    assert engine.last.devices["b"].reason is None  # its genuine update counts: no reason stays behind


@pytest.mark.slow
def test_a_device_whose_upload_the_transport_refuses_is_retried_once_not_until_the_deadline(tmp_path: Path) -> None:
    engine, link = run_round(tmp_path, TooLargeLink, rejected_grace_s=1.0)
    assert sorted(link.assignments) == ["a", "b", "b"]
    assert engine.refusals == {("b", "transfer_refused"): 2}
    assert {d: m.status for d, m in engine.last.devices.items()} == {"a": "accepted", "b": "rejected"}
    assert engine.last.devices["b"].reason == "transfer_refused"
    assert engine.last.seconds < 10  # closed after the refusal grace, not at the 20 s deadline


@pytest.mark.slow
def test_a_device_refusing_a_bad_assignment_fails_that_round_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="fedfleet.engine"):
        run_round(tmp_path, BadAssignmentOnceLink, rounds=2)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line)["devices"] for line in metrics)
    assert (first["a"]["status"], first["b"]["status"]) == ("accepted", "failed")
    assert (first["a"]["reason"], first["b"]["reason"]) == (None, "bad_assignment")
    assert first["b"]["error"] == (
        "bad_assignment: BadAssignment: assignment does not fit the model: 'fc.weight' is torch.float64, "
        "expected torch.float32"
    )
    assert "b refused its assignment as not fitting the model its spec builds" in caplog.text
    assert (second["a"]["status"], second["b"]["status"]) == ("accepted", "accepted")


@pytest.mark.slow
def test_a_program_raising_type_error_in_process_fails_that_round_with_the_reason_and_the_next_round_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PROGRAMS, "fedavg", with_first_upload_bug(PROGRAMS["fedavg"]))
    run_round(tmp_path, MemoryLink, rounds=2)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line)["devices"] for line in metrics)
    failed = [row for row in first.values() if row["status"] == "failed"]
    assert sorted(row["status"] for row in first.values()) == ["accepted", "failed"]
    assert failed[0]["error"] == f"error: TypeError: {BUG}"
    assert {d: row["status"] for d, row in second.items()} == {"a": "accepted", "b": "accepted"}


def test_devices_assigned_the_same_model_get_it_encoded_once_per_round(tmp_path: Path, monkeypatch) -> None:
    import coordinator.rounds.dispatch as dispatch

    encodes: list[int] = []

    def counted(tensors):
        encodes.append(len(tensors))
        return encode_tensors(tensors)

    monkeypatch.setattr(dispatch, "encode_tensors", counted)
    _engine, link = run_round(tmp_path, RecordingLink, rounds=2)
    assert sorted(link.assignments) == ["a", "a", "b", "b"]
    assert len(encodes) == 2  # one FedAvg model a round, for both devices
