"""The fedfleet wire protocol, shared by the device agent and the coordinator.

Transport knows bytes and messages, not federated learning: ``messages`` (JSON control messages,
versioned), ``codec`` (tensors as safetensors bytes), ``topics`` (MQTT layout confining each
device), ``engine`` (chunked, verified, resumable transfers, sans-IO: frames in, frames and events out;
``transfer`` re-exports its names), ``carrier`` with ``connection`` and ``client`` (paho-mqtt: persistence,
will, reconnects) and ``session`` (the join of the two: threads, locks, handlers).
"""
