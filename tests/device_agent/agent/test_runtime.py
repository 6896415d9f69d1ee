"""An agent, over a real broker or a fake coordinator port: a round it cannot do is answered round_failed, and the
agent takes the next one."""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import paho.mqtt.client as mqtt
import pytest
import torch
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.agent.config import AgentConfig, parse_config
from device_agent.agent.port import Signer
from device_agent.agent.runtime import ACKED_RECEIPT_TIMEOUT_S, RECEIPT_TIMEOUT_S, Agent, SentUpdate
from device_agent.clients import PROGRAMS
from device_agent.clients.spec import TrainConfig
from device_agent.training import driver
from device_agent.wire.codec import encode_tensors
from device_agent.wire.messages import Assignment, Error, Hello, Message, RoundFailed, Status, parse_message
from device_agent.wire.session import coordinator_session
from device_agent.wire.topics import DeviceTopics, fleet_uplinks
from device_agent.wire.transfer import Completed
from tests.device_profiles import reported_profile
from tests.program_bugs import BUG, with_first_upload_bug
from tests.transport_fixtures import TestBroker

DEVICE = "dev-a"
CNN = ModelSpec("cnn", 10, 1, 8)
Heard = TypeVar("Heard")


def agent_config(broker: TestBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AgentConfig:
    """dev-a of ``broker``'s fleet, its password in the environment, its state under ``tmp_path``."""
    monkeypatch.setenv("FEDFLEET_TEST_DEV_A", broker.credentials[DEVICE].password)
    return parse_config(
        {
            "device": DEVICE,
            "fleet": broker.fleet,
            "transport": {"broker": {"url": broker.address(DEVICE).url, "password": "env:FEDFLEET_TEST_DEV_A"}},
            "device_type": "cpu",
            "state_dir": str(tmp_path / "agent"),
        }
    )


@pytest.mark.slow
def test_a_bad_assignment_fails_its_round_named_and_the_next_round_trains(
    fresh_mosquitto: TestBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = fresh_mosquitto
    config = agent_config(broker, tmp_path, monkeypatch)
    heard: queue.Queue[Message | Completed] = queue.Queue()
    coordinator = coordinator_session(
        broker.fleet,
        broker.address(),
        on_message=lambda _topic, message: heard.put(message),
        on_payload=lambda _topic, completed: heard.put(completed),
    ).start()
    topics = DeviceTopics(broker.fleet, DEVICE)
    sent = build_strategy("fedavg", CNN, {}, seed=0).configure(1, [ClientSlot(DEVICE, 1.0, 100)])[DEVICE]
    bad = {**sent.tensors, "conv1.weight": sent.tensors["conv1.weight"].to(torch.complex64)}
    agent = Agent(config, reported_profile())
    serving = threading.Thread(target=agent.run, kwargs={"connect_timeout": 60}, daemon=True)
    serving.start()

    def next_heard(kind: type[Heard]) -> Heard:
        """The next message or payload of ``kind`` within a minute; heartbeats and the like in between are skipped."""
        deadline = time.monotonic() + 60
        while True:
            got = heard.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(got, kind):
                return got

    def assign(round_: int, tensors: dict[str, torch.Tensor]) -> None:
        delivery = coordinator.send(topics.down, encode_tensors(tensors), run="r1", round=round_, kind="assignment")
        assignment = Assignment(
            run="r1", round=round_, deadline_s=60, download=delivery.transfer, spec=sent.spec, train=TrainConfig()
        )
        coordinator.publish(topics.down, assignment)

    try:
        next_heard(Hello)
        assign(1, bad)
        failed = next_heard(RoundFailed)
        assign(2, sent.tensors)
        update = next_heard(Completed)
    finally:
        agent.stop()
        serving.join(30)
        coordinator.stop()

    assert (failed.round, failed.reason) == (1, "bad_assignment")
    assert "'conv1.weight' is torch.complex64, expected torch.float32" in failed.detail
    assert (update.manifest.round, update.manifest.kind) == (2, "update")


class FakeCoordinator:
    """A :class:`~device_agent.agent.port.CoordinatorPort` in memory: what a test coordinator sends and hears."""

    where = "a test's fake coordinator"

    def __init__(self) -> None:
        self.heard: queue.Queue[Message | dict] = queue.Queue()
        self.connects = 0

    def start(self, on_message, on_payload, timeout: float | None = None) -> None:
        self.assign, self.deliver = on_message, on_payload
        self.connects = 1

    def stop(self) -> None:
        pass

    def publish(self, message: Message, retain: bool = False) -> None:
        self.heard.put(message)

    def send(self, payload: bytes, sign: Signer | None = None, **fields: Any) -> Any:
        self.heard.put(fields)
        return SimpleNamespace(error=None, refused=False, done=False)  # never acked: the agent waits for its receipt

    def cancel(self, transfer: str) -> None:
        self.heard.put({"cancelled": transfer})

    def fatal(self) -> str | None:
        return None

    def assign_round(self, round_: int, sent: Any) -> None:
        """Send ``sent`` (a strategy's ClientAssignment) as round ``round_``: its model, then its assignment."""
        transfer = f"{round_:032x}"
        self.deliver(transfer, encode_tensors(sent.tensors))
        self.assign(
            Assignment(run="r1", round=round_, deadline_s=60, download=transfer, spec=sent.spec, train=TrainConfig())
        )

    def next(self, kind: type[Heard]) -> Heard:
        deadline = time.monotonic() + 60
        while not isinstance(got := self.heard.get(timeout=max(0.0, deadline - time.monotonic())), kind):
            pass
        return got


@contextmanager
def agent_beside(
    coordinator: FakeCoordinator, state: Path
) -> Iterator[tuple[Agent, FakeCoordinator, threading.Thread]]:
    """An agent serving on its own thread with ``coordinator`` as its port; stopped on the way out."""
    config = parse_config(
        {
            "device": DEVICE,
            "fleet": "test",
            "transport": {"broker": {"url": "mqtt://127.0.0.1:1"}},
            "state_dir": str(state),
        }
    )
    agent = Agent(config, reported_profile(), port=coordinator)
    serving = threading.Thread(target=agent.run, daemon=True)
    serving.start()
    try:
        yield agent, coordinator, serving
    finally:
        agent.stop()
        serving.join(30)


@pytest.mark.slow
def test_a_program_raising_type_error_fails_its_round_and_the_same_agent_trains_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = build_strategy("fedavg", CNN, {}, seed=0).configure(1, [ClientSlot(DEVICE, 1.0, 100)])[DEVICE]
    monkeypatch.setitem(PROGRAMS, "fedavg", with_first_upload_bug(PROGRAMS["fedavg"]))
    with agent_beside(FakeCoordinator(), tmp_path) as (_agent, coordinator, serving):
        coordinator.next(Hello)
        coordinator.assign_round(1, sent)
        failed = coordinator.next(RoundFailed)
        coordinator.assign_round(2, sent)
        update = coordinator.next(dict)
        alive = serving.is_alive()

    assert (failed.round, failed.reason, failed.detail) == (1, "error", f"TypeError: {BUG}")
    assert (update["round"], update["kind"]) == (2, "update")
    assert alive


@pytest.mark.slow
def test_a_newer_rounds_assignment_stops_the_older_update_still_on_its_way(tmp_path: Path) -> None:
    """Round 1 closed while its update was still uploading: the agent cancels that transfer and drops the
    update (it could only be late), then trains round 2; its outbox keeps nothing of round 1."""
    sent = build_strategy("fedavg", CNN, {}, seed=0).configure(1, [ClientSlot(DEVICE, 1.0, 100)])[DEVICE]
    with agent_beside(FakeCoordinator(), tmp_path) as (agent, coordinator, _serving):
        coordinator.next(Hello)
        coordinator.assign_round(1, sent)
        first = coordinator.next(dict)
        coordinator.assign_round(2, sent)
        cancelled = coordinator.next(dict)
        second = coordinator.next(dict)
        pending = [(item.run, item.round) for item in agent.outbox.pending()]

    assert first["round"] == 1
    assert cancelled == {"cancelled": first["transfer"]}
    assert second["round"] == 2
    assert pending == [("r1", 2)]


@pytest.mark.slow
def test_an_agent_refused_for_another_run_trains_the_assignment_it_is_sent_now(
    mosquitto: TestBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Over a real broker: its round 1 update went to a coordinator of another run, which refused it naming the
    transfer; the resumed run then assigns round 1 again, and the agent trains it (before, it took the round as
    done and ignored the assignment, so the resumed run's rounds closed 0/3)."""
    heard: queue.Queue[Message | Completed] = queue.Queue()
    coordinator = coordinator_session(
        mosquitto.fleet,
        mosquitto.address(),
        on_message=lambda _topic, message: heard.put(message),
        on_payload=lambda _topic, completed: heard.put(completed),
    ).start()
    topics = DeviceTopics(mosquitto.fleet, DEVICE)
    sent = build_strategy("fedavg", CNN, {}, seed=0).configure(1, [ClientSlot(DEVICE, 1.0, 100)])[DEVICE]
    agent = Agent(agent_config(mosquitto, tmp_path, monkeypatch), reported_profile())
    serving = threading.Thread(target=agent.run, kwargs={"connect_timeout": 60}, daemon=True)

    def next_heard(kind: type[Heard]) -> Heard:
        deadline = time.monotonic() + 60
        while not isinstance(got := heard.get(timeout=max(0.0, deadline - time.monotonic())), kind):
            pass
        return got

    def assign_round_1() -> None:
        delivery = coordinator.send(topics.down, encode_tensors(sent.tensors), run="r1", round=1, kind="assignment")
        assignment = Assignment(
            run="r1", round=1, deadline_s=60, download=delivery.transfer, spec=sent.spec, train=TrainConfig()
        )
        coordinator.publish(topics.down, assignment)

    with caplog.at_level(logging.INFO, logger="fedfleet.agent"):
        serving.start()
        try:
            next_heard(Hello)
            assign_round_1()
            first = next_heard(Completed).manifest
            refusal = f"update for run 'r1', but this run is '{'b' * 32}'"
            coordinator.publish(topics.down, Error(code="rejected", detail=refusal, transfer=first.transfer))
            while next_heard(Status).state != "idle":
                pass
            assign_round_1()
            again = next_heard(Completed).manifest
        finally:
            agent.stop()
            serving.join(30)
            coordinator.stop()

    assert (first.round, again.round) == (1, 1)
    assert again.transfer != first.transfer
    assert sum("round 1 trained" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.slow
def test_no_copy_of_the_received_model_is_held_while_it_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's devices are all mid-round at once: none may keep its received payload (or a queued event's
    reference to it) through training."""
    sent = build_strategy("fedavg", CNN, {}, seed=0).configure(1, [ClientSlot(DEVICE, 1.0, 100)])[DEVICE]
    size = len(encode_tensors(sent.tensors))
    large_blocks: list[int] = []
    real = driver.train_assignment

    def spy(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        large_blocks.append(sum(1 for trace in tracemalloc.take_snapshot().traces if trace.size >= size))
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "train_assignment", spy)
    tracemalloc.start()
    try:
        with agent_beside(FakeCoordinator(), tmp_path) as (_agent, coordinator, _serving):
            coordinator.next(Hello)
            coordinator.assign_round(1, sent)  # the payload bytes (traced) exist only in the agent from here
            update = coordinator.next(dict)
    finally:
        tracemalloc.stop()
    assert update["round"] == 1
    assert large_blocks == [0]


def test_when_an_update_is_sent_again() -> None:
    """A failed transfer at once unless the coordinator refused it; an unanswered one after the receipt
    timeout, an acked one (the coordinator has the bytes) after a longer one, each doubling per re-send."""

    def sent(resends: int = 0, **upload: Any) -> SentUpdate:
        state = {"error": None, "refused": False, "done": False} | upload
        return SentUpdate(None, "t", SimpleNamespace(**state), since=0.0, resends=resends)  # type: ignore[arg-type]

    assert sent(error="no answer").due(1.0) and not sent(error="rejected", refused=True).due(1e9)
    assert not sent().due(RECEIPT_TIMEOUT_S) and sent().due(RECEIPT_TIMEOUT_S + 1)
    assert not sent(1).due(2 * RECEIPT_TIMEOUT_S) and sent(1).due(2 * RECEIPT_TIMEOUT_S + 1)
    assert not sent(done=True).due(ACKED_RECEIPT_TIMEOUT_S) and sent(done=True).due(ACKED_RECEIPT_TIMEOUT_S + 1)


def test_any_status_counts_as_the_heartbeat_and_a_silent_agent_still_beats(tmp_path: Path) -> None:
    from device_agent.wire.messages import Status

    config = parse_config(
        {
            "device": DEVICE,
            "fleet": "test",
            "transport": {"broker": {"url": "mqtt://127.0.0.1:1"}},
            "state_dir": str(tmp_path),
            "heartbeat_s": 0.4,
        }
    )
    coordinator = FakeCoordinator()
    agent = Agent(config, reported_profile(), port=coordinator)
    serving = threading.Thread(target=agent.run, daemon=True)
    serving.start()
    try:
        coordinator.next(Hello)
        for _ in range(10):  # a status every 0.15 s, as a device in the middle of a round says what it does
            agent._events.put(lambda: agent._set_state("training", "busy"))
            time.sleep(0.15)
        deadline = time.monotonic() + 60  # the agent's thread sends the tenth after this loop put it
        while sum(getattr(m, "detail", None) == "busy" for m in list(coordinator.heard.queue)) < 10:
            assert time.monotonic() < deadline, "the agent never sent its ten statuses"
            time.sleep(0.01)
        heard = list(coordinator.heard.queue)
        busy = [m for m in heard if isinstance(m, Status)]

        def beats() -> list[Status]:
            return [m for m in list(coordinator.heard.queue)[len(heard) :] if isinstance(m, Status)]

        while len(beats()) < 2:  # silent now: it beats again, every heartbeat_s
            assert time.monotonic() < deadline, f"{len(beats())} heartbeats in 60 s of silence"
            time.sleep(0.01)
        beaten = beats()
    finally:
        agent.stop()
        serving.join(10)
    assert len([m for m in busy if m.detail == "busy"]) == 10
    assert all(m.state == "training" and m.detail == "" for m in beaten)
    # A beat (detail "") comes only after heartbeat_s without any status, by the agent's own send times: a busy
    # device sends none while it keeps talking (a loaded host may stall the 0.15 s loop past 0.4 s, and then
    # one is due), nor faster than heartbeat_s when silent.
    statuses = busy + beaten
    gaps = [b.sent_at - a.sent_at for a, b in itertools.pairwise(statuses) if b.detail == ""]
    assert len(gaps) >= 2 and min(gaps) >= 0.4 - 0.01, gaps


@pytest.mark.slow
def test_a_stopped_agent_leaves_itself_offline_for_a_coordinator_that_comes_later(
    fresh_mosquitto: TestBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean disconnect discards the will: without this, the next run's coordinator counted the device online."""

    def retained() -> list[Message]:
        """The retained messages a coordinator subscribing now would get first (a fresh, clean subscriber).

        The broker queues a subscription's retained messages as it handles the SUBSCRIBE, so a message the
        probe publishes to its own second subscription after it arrives behind them: once that marker is
        back, every retained message is in (a fixed wait missed them on a loaded host).
        """
        heard: list[Message] = []
        marker_topic = f"fedfleet/{fresh_mosquitto.fleet}/probe-{time.monotonic_ns()}"
        marker = threading.Event()

        def on_message(_client: mqtt.Client, _userdata: object, msg: mqtt.MQTTMessage) -> None:
            if msg.topic == marker_topic:
                marker.set()
            elif msg.retain:
                heard.append(parse_message(msg.payload))

        address = fresh_mosquitto.address()
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"probe-{time.monotonic_ns()}")
        client.username_pw_set(address.username, address.password)
        client.on_message = on_message
        client.connect(address.host, address.port)
        client.subscribe(fleet_uplinks(fresh_mosquitto.fleet), qos=1)
        client.subscribe(marker_topic, qos=1)
        client.publish(marker_topic, b"end", qos=1)
        client.loop_start()
        try:
            assert marker.wait(60), "the probe's own marker never came back from the broker"
        finally:
            client.disconnect()
            client.loop_stop()
        return heard

    agent = Agent(agent_config(fresh_mosquitto, tmp_path, monkeypatch), reported_profile())
    serving = threading.Thread(target=agent.run, kwargs={"connect_timeout": 60}, daemon=True)
    serving.start()
    deadline = time.monotonic() + 60
    running = retained()
    while not any(isinstance(m, Hello) for m in running) and time.monotonic() < deadline:
        running = retained()
    agent.stop()
    serving.join(30)
    after = retained()

    assert any(isinstance(m, Hello) for m in running)
    # Not the will's "connection lost": the session waits for the status's PUBACK before its DISCONNECT.
    assert [(m.state, m.detail) for m in after if isinstance(m, Status)] == [("offline", "stopped")]
    assert not any(isinstance(m, Hello) for m in after)
