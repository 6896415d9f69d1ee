"""The sender's side of a session: every outgoing transfer, its receiver's answers, re-announcements and resumes.

Pure bookkeeping under the session's lock: it returns the frames to publish and leaves publishing to the
carrier (``Session._publish``), which must never run under that lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from device_agent.wire import topics
from device_agent.wire.delivery import Delivery
from device_agent.wire.guard import InboundGuard
from device_agent.wire.messages import Ack, Manifest, Nack, encode
from device_agent.wire.settings import SessionConfig
from device_agent.wire.transfer import Limits, OutgoingTransfer, PayloadTooLarge, announce, new_transfer_id

log = logging.getLogger("fedfleet.wire")

Frames = list[tuple[str, str | None, bytes]]
"""(topic, transfer id or None, frame) to publish, in order."""


def prepare(
    config: SessionConfig, payload: bytes, manifest: Manifest | None, **manifest_fields: Any
) -> OutgoingTransfer:
    """A transfer of ``payload``, refused now if it breaks a limit (see ``Session.send``)."""
    if manifest is None:
        manifest = announce(len(payload), config.chunk_size, limits=config.limits, **manifest_fields)
    else:
        config.limits.check(manifest.size, manifest.chunk_size)
        manifest = manifest.model_copy(update={"transfer": manifest_fields.get("transfer") or new_transfer_id()})
    # The seal is the largest control message of a transfer: check it before the first byte leaves.
    placeholder = ["0" * 64] * manifest.chunk_count
    seal = manifest.model_copy(update={"chunks": placeholder, "digest": "0" * 64})
    check_packet(config.limits, len(encode(seal)), "manifest")
    return OutgoingTransfer(
        manifest, payload, time.monotonic(), resend_after=config.resend_after_s, max_attempts=config.max_attempts
    )


def check_packet(limits: Limits, size: int, what: str) -> None:
    """Refuse a publish the broker would drop for its size (paho does not check)."""
    if size + 512 > limits.max_packet_bytes:
        raise PayloadTooLarge(
            f"{what} of {size} bytes would exceed the broker's {limits.max_packet_bytes}-byte "
            "maximum packet size; nothing was sent"
        )


class Senders:
    """Outgoing transfers by id, each with the topic it goes to and its :class:`Delivery`."""

    def __init__(self, name: str, lock: threading.RLock, guard: InboundGuard | None = None) -> None:
        self._name = name
        self._lock = lock
        self._guard = guard
        self._outgoing: dict[str, tuple[str, OutgoingTransfer, Delivery]] = {}

    def __bool__(self) -> bool:
        return bool(self._outgoing)

    def __contains__(self, transfer: object) -> bool:
        return transfer in self._outgoing

    def add(self, topic: str, outgoing: OutgoingTransfer) -> Delivery:
        delivery = Delivery(outgoing.transfer)
        with self._lock:
            self._outgoing[outgoing.transfer] = (topic, outgoing, delivery)
        return delivery

    def touch(self, transfer: str, now: float) -> None:
        """The broker took one of ``transfer``'s frames: it is progressing."""
        entry = self._outgoing.get(transfer)
        if entry is not None:
            # Without the lock on purpose (called from paho's on_publish): a lone float update, atomic under the GIL.
            entry[1].touch(now)

    def answer(self, message: Ack | Nack, now: float, source: str) -> Frames:
        """Take a receiver's ack or nack; the frames a nack asks for again."""
        with self._lock:
            entry = self._outgoing.get(message.transfer)
            if entry is None:
                return []  # an answer to a transfer already settled: a duplicate ack
            topic, outgoing, delivery = entry
            if topics.device_of(topic) != topics.device_of(source):
                if self._guard is not None:  # only the transfer's receiver may ack or nack it
                    detail = f"a {message.type} for a transfer to {topics.device_of(topic)}"
                    self._guard.refuse(topics.device_of(source) or source, "wrong_sender", detail, now)
                return []
            if isinstance(message, Nack):
                return [(topic, outgoing.transfer, frame) for frame in outgoing.on_nack(message, now)]
            outgoing.on_ack(message)
            del self._outgoing[message.transfer]
        delivery.settle(outgoing.failed)
        return []

    def fail(self, transfer: str, error: str) -> None:
        """The receiver refused ``transfer``."""
        with self._lock:
            entry = self._outgoing.pop(transfer, None)
        if entry is not None:
            entry[2].refused = True
            entry[2].settle(error)

    def cancel(self, stale: Callable[[Manifest], bool], why: str) -> int:
        """Stop every transfer whose manifest is ``stale``; their deliveries fail with ``why``. How many."""
        with self._lock:
            cancelled = [tid for tid, (_t, outgoing, _d) in self._outgoing.items() if stale(outgoing.manifest)]
            entries = [self._outgoing.pop(tid) for tid in cancelled]
        for _topic, _outgoing, delivery in entries:
            delivery.settle(f"cancelled: {why}")
        return len(entries)

    def resume(self, now: float) -> Frames:
        """After a reconnect: every unfinished transfer re-announced."""
        with self._lock:
            return [
                (topic, outgoing.transfer, frame)
                for topic, outgoing, _delivery in self._outgoing.values()
                for frame in outgoing.resume(now)
            ]

    def poll(self, now: float, waiting: set[str]) -> Frames:
        """Re-announcements due; transfers that gave up fail (their deliveries settle outside the lock).

        A transfer in ``waiting`` (still in the send window's backlog) waits for us, not for its receiver.
        """
        frames: Frames = []
        failed: list[tuple[OutgoingTransfer, Delivery]] = []
        with self._lock:
            for tid, (topic, outgoing, delivery) in list(self._outgoing.items()):
                if tid in waiting:
                    outgoing.touch(now)
                frames += [(topic, tid, frame) for frame in outgoing.poll(now)]
                if outgoing.failed:
                    del self._outgoing[tid]
                    failed.append((outgoing, delivery))
        for outgoing, delivery in failed:
            log.warning("%s: transfer %s failed: %s", self._name, outgoing.transfer, outgoing.failed)
            delivery.settle(outgoing.failed)
        return frames
