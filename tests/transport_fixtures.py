"""Real brokers for tests, started on free ports; reused by the end-to-end tests.

- ``mosquitto`` (session scope): a managed mosquitto for fleet ``test`` with the coordinator and
  devices ``dev-a``, ``dev-b``, ``dev-c``; skips the test if mosquitto is not installed.
- ``amqtt`` (session scope): the amqtt fallback with the same fleet and users.
- ``fresh_mosquitto`` (function scope): a private mosquitto a test may stop, kill and restart.

Each is a ``TestBroker``: ``.broker`` (``start``/``stop``), ``.fleet``, ``.credentials`` and
``address(user)`` giving the ``BrokerAddress`` to log in as ``user``, and ``agent_config(device, folder)``
an in-process ``Agent``'s config on it (its password in a ``file:`` secret under ``folder``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.transport.broker.base import BrokerSettings, ManagedBroker
from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials, generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from device_agent.agent.config import AgentConfig, parse_config
from device_agent.wire.session import BrokerAddress

FLEET = "test"
DEVICES = ("dev-a", "dev-b", "dev-c")


@dataclass
class TestBroker:
    __test__ = False  # not a test class, despite the name

    broker: ManagedBroker
    fleet: str
    credentials: dict[str, Credentials]

    def address(self, user: str = COORDINATOR_USER) -> BrokerAddress:
        return self.broker.address_for(self.credentials[user])

    def agent_config(self, device: str, folder: Path) -> AgentConfig:
        """``device``'s agent config on this broker: its login as a ``file:`` secret, its state under ``folder``."""
        secret = folder / f"{device}.password"
        secret.parent.mkdir(parents=True, exist_ok=True)
        secret.write_text(self.credentials[device].password)
        return parse_config(
            {
                "device": device,
                "fleet": self.fleet,
                "transport": {"broker": {"url": self.address(device).url, "password": f"file:{secret}"}},
                "device_type": "cpu",
                "state_dir": str(folder / "agents" / device),
                "heartbeat_s": 2,
            }
        )


def _workdir() -> Path:
    # Not pytest's tmp_path: its 0700 parents keep out mosquitto, which drops root to its own user.
    return scratch_dir("fedfleet-broker-")


def _start(kind: str) -> TestBroker:
    if kind == "mosquitto" and find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    credentials = generate_credentials(DEVICES)
    settings = BrokerSettings(FLEET, _workdir(), credentials)
    if kind == "mosquitto":
        broker: ManagedBroker = MosquittoBroker(settings)
    else:
        from coordinator.transport.broker.amqtt_broker import AmqttBroker

        broker = AmqttBroker(settings)
    broker.start(timeout=60)  # a loaded host starts amqtt (Python) in well over its default 20 s
    return TestBroker(broker, FLEET, credentials)


@pytest.fixture(scope="session")
def mosquitto() -> Iterator[TestBroker]:
    running = _start("mosquitto")
    yield running
    running.broker.stop()


@pytest.fixture(scope="session")
def amqtt() -> Iterator[TestBroker]:
    running = _start("amqtt")
    yield running
    running.broker.stop()


@pytest.fixture
def fresh_mosquitto() -> Iterator[TestBroker]:
    running = _start("mosquitto")
    yield running
    running.broker.stop()
