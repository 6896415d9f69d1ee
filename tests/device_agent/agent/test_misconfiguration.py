"""An agent that cannot take part says why and stops: wrong fleet name, a coordinator that cannot read it, no broker."""

from __future__ import annotations

import datetime as dt
import json
import socket
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from device_agent.agent.config import AgentConfig, parse_config
from device_agent.agent.runtime import Agent, AgentError, run_agent
from device_agent.wire.messages import PROTOCOL_VERSION, encode, incompatible
from device_agent.wire.topics import DeviceTopics
from tests.device_agent.wire.tls_servers import make_pki, tls_server
from tests.device_profiles import reported_profile
from tests.transport_fixtures import TestBroker

PROFILE = reported_profile()


def _config(broker: TestBroker, fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AgentConfig:
    monkeypatch.setenv("FEDFLEET_TEST_DEV_A", broker.credentials["dev-a"].password)
    return parse_config(
        {
            "device": "dev-a",
            "fleet": fleet,
            "transport": {"broker": {"url": broker.address("dev-a").url, "password": "env:FEDFLEET_TEST_DEV_A"}},
            "device_type": "cpu",
            "state_dir": str(tmp_path / "agent"),
        }
    )


def test_a_wrong_fleet_name_stops_the_agent_with_the_likely_cause(
    mosquitto: TestBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = Agent(_config(mosquitto, "not-the-fleet", tmp_path, monkeypatch), PROFILE)

    with pytest.raises(AgentError, match="is fleet 'not-the-fleet' the coordinator's fleet name"):
        agent.run(connect_timeout=10)


@pytest.mark.slow
def test_only_a_coordinator_that_cannot_read_this_agent_stops_it(
    mosquitto: TestBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong-version message, or the coordinator's answer to one someone else sent with this device's
    login (a spoofed version-2 message), leaves the agent running; an answer naming its own version stops it."""
    agent = Agent(_config(mosquitto, mosquitto.fleet, tmp_path, monkeypatch), PROFILE)
    topics = DeviceTopics(mosquitto.fleet, "dev-a")
    answers: list[dict] = []
    coordinator = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    login = mosquitto.address()
    coordinator.username_pw_set(login.username, login.password)
    coordinator.on_message = lambda _c, _u, msg: answers.append(json.loads(msg.payload)) if msg.payload else None
    coordinator.connect(login.host, login.port)
    coordinator.subscribe(topics.up, qos=1)
    coordinator.loop_start()
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            agent.run(connect_timeout=10)
        except AgentError as exc:
            failure.append(exc)

    serving = threading.Thread(target=serve)
    serving.start()
    try:
        for _ in range(200):  # the agent's hello: it is connected and subscribed
            if any(a.get("type") == "hello" for a in answers):
                break
            serving.join(0.05)
        for harmless in (encode(incompatible(2)), json.dumps({"v": 99, "type": "assignment"}).encode()):
            coordinator.publish(topics.down, harmless, qos=1).wait_for_publish(5)
        serving.join(2)
        assert serving.is_alive() and not failure
        assert {"type": "error", "code": "incompatible"}.items() <= answers[-1].items()  # it answered the v99
        coordinator.publish(topics.down, encode(incompatible(PROTOCOL_VERSION)), qos=1).wait_for_publish(5)
        serving.join(10)
    finally:
        agent.stop()
        serving.join(10)
        coordinator.loop_stop()
        coordinator.disconnect()

    assert "protocol version 3 is not spoken here" in str(failure[0])


def test_nothing_listening_on_the_broker_port_is_named_and_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = parse_config(
        {
            "device": "dev-a",
            "fleet": "test",
            "transport": {"broker": {"url": f"mqtt://127.0.0.1:{port}"}},
            "connect_timeout_s": 2,
            "state_dir": str(tmp_path / "agent"),
        }
    )

    with pytest.raises(AgentError, match=rf"nothing is listening on 127.0.0.1:{port} .* gave up after 1 s"):
        run_agent(config, PROFILE)


def test_a_tls_handshake_that_keeps_failing_ends_at_the_connect_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TCP opens but the handshake fails (a clock before the certificate): exit with the cause, not retry forever."""
    now = dt.datetime.now(dt.timezone.utc)
    pki = make_pki(tmp_path / "pki", now + dt.timedelta(days=2), now + dt.timedelta(days=30))
    monkeypatch.setenv("FEDFLEET_TEST_DEV_A", "pw")
    with tls_server(pki) as port:
        config = parse_config(
            {
                "device": "dev-a",
                "fleet": "demo",
                "transport": {
                    "broker": {
                        "url": f"mqtts://localhost:{port}",
                        "password": "env:FEDFLEET_TEST_DEV_A",
                        "ca_file": str(pki.ca_file),
                    }
                },
                "device_type": "cpu",
                "state_dir": str(tmp_path / "agent"),
                "connect_timeout_s": 2,
            }
        )
        started = time.monotonic()
        with pytest.raises(AgentError) as raised:
            run_agent(config, PROFILE)
    assert time.monotonic() - started < 15
    message = str(raised.value)
    assert f"could not connect to mqtts://localhost:{port} within 2 s (connect_timeout_s, --connect-timeout)" in message
    assert "not yet valid" in message
