"""The WebSocket carrier: the wire protocol over one WebSocket per device (TLS on port 443-like networks).

For devices on networks that pass only HTTPS, where MQTT's port is closed. The frames are MQTT's: control
messages as compact JSON and chunk frames as 57-byte-header binaries, each one WebSocket binary message;
transfers are the sans-IO transfer engine's (``device_agent.wire.engine``), not a protocol of their own.

- ``endpoint``: the join of the engine with open connections, one per route (a device on the coordinator, the
  coordinator on a device): frames in from any connection's reader thread, frames out through each
  connection's writer (``pipe``), the send window, the timer and the handler dispatcher of MQTT's session;
- ``client``: a device's connection: TLS with the kit's CA and client certificate, its login in an
  ``Authorization`` header, reconnects with backoff, resumes of unfinished transfers after each.

The coordinator's server is ``coordinator.transport.websocket``: it checks each device's certificate and
login, gives each connection its device as route (a device speaks only for itself), and says a device is
offline when its connection closes (MQTT's last will).
"""
