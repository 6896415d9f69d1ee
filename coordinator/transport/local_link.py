"""Devices in this process behind the engine's :class:`~coordinator.transport.link.Link` port.

What the simulation and ``benchmarks.compare`` run on: the real round engine (planning, upload
gate, journal, evaluation) with in-process devices instead of MQTT agents. Nothing is passed by
reference: assignments are encoded to safetensors and decoded on the device side, uploads are
encoded, hashed into a sealed manifest and decoded by the engine, exactly as over the broker; the
device side is :func:`device_agent.training.driver.run_assignment`, the agent's own round, so a
failing round (a program's bug, out of memory) is answered and cleaned up as on a device. Devices
train one at a time on one worker thread, in the order their assignments arrive.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from coordinator.transport.link import MessageHandler, PayloadHandler, RefusalHandler
from device_agent.training.driver import RoundFailure, run_assignment
from device_agent.wire.codec import encode_tensors
from device_agent.wire.messages import Assignment, Manifest, Message, Status, encode
from device_agent.wire.payload import PayloadDigest, Received
from device_agent.wire.protocol import UPDATE_KIND, upload_meta
from device_agent.wire.transfer import DEFAULT_CHUNK_SIZE, make_manifest, new_transfer_id

log = logging.getLogger("fedfleet.local")

Split = tuple[Tensor, Tensor]


@dataclass
class LocalDevice:
    """One in-process device: its data shards and what it keeps between rounds (personalized strategies)."""

    device_id: str
    train: Split
    test: Split
    kept: dict[str, Tensor] | None = field(default=None, repr=False)

    def shards(self, assignment: Assignment) -> tuple[Split, Split]:
        """Its (train, test) data, already shaped for the fleet's model."""
        return self.train, self.test

    def load(self, run: str) -> Mapping[str, Tensor] | None:
        """What this device kept from its last round (in memory: one run per link)."""
        return self.kept

    def save(self, run: str, tensors: Mapping[str, Tensor]) -> None:
        self.kept = dict(tensors) or None


class InProcessLink:
    """The Link of an in-process fleet; every device is online from :meth:`start` on."""

    def __init__(
        self, devices: Sequence[LocalDevice], chunk_size: int = DEFAULT_CHUNK_SIZE, torch_device: str = "cpu"
    ) -> None:
        self.devices = {d.device_id: d for d in devices}
        self.chunk_size = chunk_size
        self.torch_device = torch_device
        self._up: Counter[str] = Counter()
        self._down: Counter[str] = Counter()
        self._payloads: dict[str, bytes] = {}
        self._jobs: queue.Queue[tuple[str, Assignment] | None] = queue.Queue()
        self._closed = -1
        self._worker: threading.Thread | None = None
        self._on_message: MessageHandler = lambda _d, _m: None
        self._on_payload: PayloadHandler = lambda _d, _c: None

    def start(
        self, on_message: MessageHandler, on_payload: PayloadHandler, on_refused: RefusalHandler | None = None
    ) -> None:
        """In-process devices send nothing a transport would refuse: ``on_refused`` is never called."""
        self._on_message, self._on_payload = on_message, on_payload
        self._worker = threading.Thread(target=self._work, name="fedfleet-local-devices", daemon=True)
        self._worker.start()
        for device in self.devices:
            self._to_engine(device, Status(device=device, state="idle"))

    def stop(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None

    def send_control(self, device: str, message: Message) -> None:
        self._down[device] += len(encode(message))
        if isinstance(message, Assignment):
            self._jobs.put((device, message))

    def prepare(self, payload: bytes, **fields: Any) -> Manifest:
        return make_manifest(payload, self.chunk_size, **fields)

    def send_payload(self, device: str, payload: bytes, outgoing: Manifest) -> str:
        transfer = new_transfer_id()
        self._payloads[transfer] = payload
        self._down[device] += len(payload)
        return transfer

    def payload_in_flight(self, device: str) -> bool:
        """Payloads are handed over at once in process."""
        return False

    def delivered_ago(self, device: str) -> float | None:
        """In process a payload is handed over as it is sent: no device is ever waiting on one."""
        return None

    def close_round(self, round_: int) -> None:
        """Assignments of closed rounds still queued are not trained (a device would be told its update is late)."""
        self._closed = max(self._closed, round_)

    def bytes_up(self, device: str) -> int:
        return self._up[device]

    def bytes_down(self, device: str) -> int:
        return self._down[device]

    def _to_engine(self, device: str, message: Message) -> None:
        self._up[device] += len(encode(message))
        self._on_message(device, message)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            device_id, assignment = job
            device = self.devices[device_id]
            payload = self._payloads.pop(assignment.download)
            if assignment.round <= self._closed:
                continue
            outcome = run_assignment(
                assignment,
                payload,
                device.shards,
                device,
                torch.device(self.torch_device),
            )
            if isinstance(outcome, RoundFailure):
                log.warning("%s: round %d failed: %s: %s", device_id, assignment.round, outcome.reason, outcome.detail)
                self._to_engine(device_id, outcome.to_message(assignment))
                continue
            data = encode_tensors(outcome.upload)
            result = outcome.result
            meta = upload_meta(
                result.samples, result.seconds, result.mean_loss, outcome.local_accuracy, received=outcome.received
            )
            received = Received(
                run=assignment.run,
                round=assignment.round,
                kind=UPDATE_KIND,
                transfer=new_transfer_id(),
                meta=meta,
                digest=PayloadDigest.of(data, self.chunk_size),
                data=data,
            )
            self._up[device_id] += len(data)
            self._on_payload(device_id, received)


__all__ = ["InProcessLink", "LocalDevice"]
