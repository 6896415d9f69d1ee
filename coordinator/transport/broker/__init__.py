"""Brokers the coordinator can use: a managed mosquitto, the amqtt fallback, or an external broker by URL."""
