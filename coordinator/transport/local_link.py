"""Devices in this process behind the engine's :class:`~coordinator.transport.link.Link` port.

What the simulation and ``benchmarks.compare`` run on: the real round engine (planning, upload
gate, journal, evaluation) with in-process devices instead of MQTT agents. Nothing is passed by
reference: assignments are encoded to safetensors and decoded on the device side, uploads are
encoded, hashed into a sealed manifest and decoded by the engine, exactly as over the broker; the
device side is :func:`device_agent.training.local_round.train_assignment`, the agent's own round. Devices
train one at a time on one worker thread, in the order their assignments arrive.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from coordinator.transport.link import MessageHandler, PayloadHandler, RefusalHandler
from device_agent.clients.assignment_check import BadAssignment
from device_agent.clients.base import KeptStateMissing
from device_agent.training.local_round import train_assignment
from device_agent.training.oom import is_out_of_memory
from device_agent.wire.codec import CodecError, decode_tensors, encode_tensors
from device_agent.wire.messages import Assignment, Manifest, Message, RoundFailed, Status, encode
from device_agent.wire.protocol import UPDATE_KIND, upload_meta
from device_agent.wire.transfer import DEFAULT_CHUNK_SIZE, Completed, make_manifest, new_transfer_id

log = logging.getLogger("fedfleet.local")

Split = tuple[Tensor, Tensor]


@dataclass
class LocalDevice:
    """One in-process device: its data shards and what it keeps between rounds (personalized strategies)."""

    device_id: str
    train: Split
    test: Split
    kept: dict[str, Tensor] | None = field(default=None, repr=False)


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

    def send_payload(self, device: str, payload: bytes, manifest: Manifest) -> str:
        transfer = new_transfer_id()
        self._payloads[transfer] = payload
        self._down[device] += len(payload)
        return transfer

    def payload_in_flight(self, device: str) -> bool:
        """Payloads are handed over at once in process."""
        return False

    def bytes_up(self, device: str) -> int:
        return self._up[device]

    def bytes_down(self, device: str) -> int:
        return self._down[device]

    def _to_engine(self, device: str, message: Message) -> None:
        self._up[device] += len(encode(message))
        self._on_message(device, message)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            device, assignment = job
            try:
                self._train(self.devices[device], assignment)
            except KeptStateMissing as exc:
                self._fail(device, assignment, "state_lost", str(exc))
            except (BadAssignment, CodecError) as exc:
                self._fail(device, assignment, "bad_assignment", str(exc))
            except Exception as exc:  # one device's failure must not stop the others
                reason = "out_of_memory" if is_out_of_memory(exc) else "error"
                if reason == "error":
                    log.exception("%s: round %d failed", device, assignment.round)
                self._fail(device, assignment, reason, f"{type(exc).__name__}: {exc}")

    def _train(self, device: LocalDevice, assignment: Assignment) -> None:
        tensors = decode_tensors(self._payloads.pop(assignment.download))
        trained = train_assignment(
            assignment.spec,
            assignment.train,
            tensors,
            device.kept,
            device.train,
            device.test,
            torch.device(self.torch_device),
        )
        device.kept = trained.keep or None
        data = encode_tensors(trained.upload)
        result = trained.result
        meta = upload_meta(
            result.samples, result.seconds, result.mean_loss, trained.local_accuracy, received=trained.received
        )
        manifest = make_manifest(
            data, self.chunk_size, run=assignment.run, round=assignment.round, kind=UPDATE_KIND, meta=meta
        )
        self._up[device.device_id] += len(data)
        self._on_payload(device.device_id, Completed(manifest, [data]))

    def _fail(self, device: str, assignment: Assignment, reason: str, detail: str) -> None:
        failure = RoundFailed(run=assignment.run, round=assignment.round, reason=reason, detail=detail[:2000])  # type: ignore[arg-type]
        self._to_engine(device, failure)


__all__ = ["InProcessLink", "LocalDevice"]
