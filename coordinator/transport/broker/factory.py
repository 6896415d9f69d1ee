"""Which broker a fleet uses: an external one by URL, else a managed mosquitto, else amqtt (loudly)."""

from __future__ import annotations

import logging
import warnings

from coordinator.transport.broker.base import BrokerSettings, ManagedBroker, wait_until_healthy
from coordinator.transport.broker.credentials import Credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from device_agent.wire.session import BrokerAddress

log = logging.getLogger("fedfleet.broker")


class ExternalBroker:
    """A broker someone else runs (a mosquitto, EMQX or HiveMQ cluster): we only check we can log in.

    Its users and ACLs are its operator's business; ``address_for`` just swaps in each device's login.
    """

    protocol = "5"

    def __init__(self, address: BrokerAddress) -> None:
        self.address = address

    def address_for(self, credentials: Credentials) -> BrokerAddress:
        return self.address.with_login(credentials.username, credentials.password)

    def start(self, timeout: float = 10.0) -> None:
        wait_until_healthy(self.address, timeout)

    def stop(self) -> None:
        """Not ours to stop."""


def make_broker(settings: BrokerSettings, prefer: str = "auto") -> ManagedBroker:
    """A managed broker (not started): ``prefer`` is ``auto``, ``mosquitto`` or ``amqtt``.

    ``auto`` takes mosquitto when installed and otherwise amqtt, with a warning on the log and as a
    Python warning, since amqtt is only fit for development.
    """
    if prefer not in ("auto", "mosquitto", "amqtt"):
        raise ValueError(f"broker must be auto, mosquitto or amqtt, got {prefer!r}")
    if prefer == "mosquitto" or (prefer == "auto" and find_mosquitto()):
        return MosquittoBroker(settings)
    from coordinator.transport.broker.amqtt_broker import WARNING, AmqttBroker

    if prefer == "auto":
        log.warning(WARNING)
        warnings.warn(WARNING, RuntimeWarning, stacklevel=2)
    return AmqttBroker(settings)


def external_broker(
    url: str, username: str | None = None, password: str | None = None, ca_file: str | None = None
) -> ExternalBroker:
    """An external broker from ``mqtt://`` / ``mqtts://`` URL, with the coordinator's login and an optional CA file."""
    return ExternalBroker(BrokerAddress.from_url(url, username, password, ca_file))
