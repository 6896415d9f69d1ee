"""The agent's port to its coordinator: messages and payloads in and out, nothing about topics or manifests.

The runtime (:class:`device_agent.agent.runtime.Agent`) speaks only :class:`CoordinatorPort`; the
MQTT session, the device's topics and its last will are :class:`MqttPort`'s business. Another
transport, or a test's fake coordinator, is another class with these few methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from device_agent.agent.config import AgentConfig
from device_agent.wire.messages import Message, Status
from device_agent.wire.session import BrokerAddress, ChunkHook, Session, device_session
from device_agent.wire.topics import DeviceTopics
from device_agent.wire.transfer import Completed, make_manifest

MessageHandler = Callable[[Message], None]
PayloadHandler = Callable[[str, bytes], None]
"""Told (transfer id, verified bytes) of every payload the coordinator sent, once."""
Signer = Callable[[str, dict[str, Any]], dict[str, Any]]
"""Given (the payload's transfer digest, its meta), the meta to send: a signed upload binds that digest."""


class Upload(Protocol):
    """A payload on its way to the coordinator."""

    @property
    def error(self) -> str | None:
        """Why the transfer failed, once it has (the agent then sends it again, unless it was refused)."""
        ...

    @property
    def done(self) -> bool:
        """The coordinator acked every byte (its receipt, accepted or not, follows)."""
        ...

    @property
    def refused(self) -> bool:
        """The coordinator answered the transfer with an error: it will not take these bytes."""
        ...


class CoordinatorPort(Protocol):
    """What the agent needs from a transport. Handlers may run on any thread; the agent queues them."""

    where: str
    """Where the coordinator is reached, for the agent's log (a broker's URL)."""

    def start(self, on_message: MessageHandler, on_payload: PayloadHandler, timeout: float | None = None) -> None:
        """Connect (reconnecting on its own from then on); raises ``ConnectionError`` if it cannot."""
        ...

    def stop(self) -> None: ...

    def publish(self, message: Message, retain: bool = False) -> None:
        """Send a control message; ``retain``: a coordinator that comes later still gets the last one."""
        ...

    def send(self, payload: bytes, sign: Signer | None = None, **fields: Any) -> Upload:
        """Start sending ``payload`` described by ``fields`` (``run``, ``round``, ``kind``, ``meta``, ``transfer``).

        With ``sign`` the payload is hashed first and its meta signed over the digest before anything is sent.
        """
        ...

    def cancel(self, transfer: str) -> None:
        """Stop sending the payload of ``transfer`` (its round is over); its upload fails as cancelled."""
        ...

    @property
    def connects(self) -> int:
        """How many times the port has (re)connected: the agent re-announces itself after each."""
        ...

    def fatal(self) -> str | None:
        """Why this device can never get through (credentials refused, nothing it sends allowed); else None."""
        ...


class MqttPort:
    """The device's MQTT session: its own client id and topics, an ``offline`` last will."""

    def __init__(
        self,
        config: AgentConfig,
        before_chunk_out: ChunkHook | None = None,
        after_chunk_in: ChunkHook | None = None,
    ) -> None:
        broker = config.broker
        self.address = replace(
            BrokerAddress.from_url(
                broker.url, username=config.device, password=broker.resolve_password(), ca_file=broker.ca_file
            ),
            cert_file=broker.cert_file,
            key_file=broker.key_file,
        )
        self.where = broker.url
        self.fleet, self.device, self.protocol = config.fleet, config.device, broker.protocol
        self.keepalive_s = broker.keepalive_s
        self.topics = DeviceTopics(config.fleet, config.device)
        self._hooks = before_chunk_out, after_chunk_in
        self._session: Session | None = None
        self.connect_timeout_s = config.connect_timeout_s
        self._give_up: float | None = None
        """The monotonic deadline of the first connection; :meth:`fatal` reports it passed."""

    def start(self, on_message: MessageHandler, on_payload: PayloadHandler, timeout: float | None = None) -> None:
        """Start connecting and return at once; never connected ``timeout`` s later, :meth:`fatal` says why.

        Not a blocking wait, so a stop (Ctrl-C) during a long one is served at once.
        """
        self._session, _ = device_session(
            self.fleet,
            self.device,
            self.address,
            on_message=lambda _topic, message: on_message(message),
            on_payload=lambda _topic, completed: _hand_over(completed, on_payload),
            before_chunk_out=self._hooks[0],
            after_chunk_in=self._hooks[1],
            protocol=self.protocol,
            keepalive_s=self.keepalive_s,
        )
        self._session.start(timeout=None)
        self._give_up = None if timeout is None else time.monotonic() + timeout

    def stop(self) -> None:
        """Leave the fleet: a clean disconnect discards the ``offline`` will, so say it, and take back the hello.

        Both were retained: left as they were, a coordinator that subscribes later (a restart, the next run
        on the same broker) would count a stopped device online, plan it, and wait for it until the deadline.
        """
        if self._session is not None:
            if self._session.connected:
                self._session.publish(
                    self.topics.status, Status(device=self.device, state="offline", detail="stopped"), True
                )
                self._session.retract(self.topics.up)
            self._session.stop()

    def publish(self, message: Message, retain: bool = False) -> None:
        topic = self.topics.status if isinstance(message, Status) else self.topics.up
        self._started().publish(topic, message, retain)

    def send(self, payload: bytes, sign: Signer | None = None, **fields: Any) -> Upload:
        session = self._started()
        if sign is None:  # hashed chunk by chunk as it is published
            return session.send(self.topics.up, payload, **fields)
        config = session.config
        manifest = make_manifest(payload, config.chunk_size, limits=config.limits, **fields)
        manifest = manifest.model_copy(update={"meta": sign(manifest.digest, manifest.meta)})  # type: ignore[arg-type]
        return session.send(self.topics.up, payload, manifest=manifest, transfer=fields.get("transfer"))

    def cancel(self, transfer: str) -> None:
        self._started().cancel(lambda manifest: manifest.transfer == transfer, "superseded by a newer round")

    @property
    def connects(self) -> int:
        return 0 if self._session is None else self._session.stats.connects

    def fatal(self) -> str | None:
        session = self._started()
        if session.refused:
            return f"{session.refused}; check the device's transport.broker.password (--password)"
        if self._give_up is not None and session.stats.connects == 0 and time.monotonic() > self._give_up:
            return (
                f"could not connect to {self.address.url} within {self.connect_timeout_s:g} s (connect_timeout_s, "
                f"--connect-timeout): {session.connect_failure or 'no answer from the broker'}"
            )
        if session.stats.publish_denied and not session.stats.published:
            return (
                f"the broker refuses every message this device sends on {self.topics.up}: is fleet "
                f"{self.fleet!r} the coordinator's fleet name? (a device may publish only there)"
            )
        return None

    def _started(self) -> Session:
        if self._session is None:
            raise RuntimeError("the MQTT port is not started")
        return self._session


def _hand_over(completed: Completed, on_payload: PayloadHandler) -> None:
    on_payload(completed.manifest.transfer, completed.data)


__all__ = ["CoordinatorPort", "MqttPort", "Signer", "Upload"]
