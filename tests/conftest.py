"""Suite-wide fixtures: real brokers (see tests/transport_fixtures.py)."""

from tests.transport_fixtures import amqtt, fresh_mosquitto, mosquitto

__all__ = ["amqtt", "fresh_mosquitto", "mosquitto"]
