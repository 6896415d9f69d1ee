"""The fedfleet wire protocol, shared by the device agent and the coordinator.

Transport knows bytes and messages, not federated learning: ``messages`` (JSON control messages,
versioned), ``codec`` (tensors as safetensors bytes), ``topics`` (MQTT layout confining each
device), ``transfer`` (chunking, verification and resends as pure state machines) and ``session``
(paho-mqtt glue: connection, persistence, reconnects, driving the state machines).
"""
