"""The engine's port to its devices (MQTT or in-process) and broker management. Knows bytes, not FL."""
