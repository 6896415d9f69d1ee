"""Devices in this process behind the engine's :class:`~coordinator.transport.link.Link`: real agents over memory.

What the simulation and ``benchmarks.compare`` run on: the real round engine (planning, upload gate,
journal, evaluation) and the real device runtime, :class:`~device_agent.agent.runtime.Agent` (outbox,
receipts, re-sends, kept state on disk), one per device on its own thread, each reaching the engine
through a :class:`~device_agent.agent.memory.MemoryPort` on one :class:`~device_agent.agent.memory.MemoryHub`
instead of an MQTT session. So a simulation, an emulated fleet and a real one run the same device code;
only the bytes take a shorter way. Assignments and updates still travel as safetensors bytes and uploads
carry a transport digest, so the gate, the journal and signatures see what they see over MQTT.

Devices train one at a time, in the order the engine assigned them (:class:`Turns`), as the simulation
always did: the same seeds give the same model. With ``batch=True`` they train at once, their steps batched,
and only their uploads take turns: the same seeds then give the same model to float rounding (which steps
batch together depends on timing).
"""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from coordinator.transport.link import MessageHandler, PayloadHandler, RefusalHandler
from device_agent.agent.config import AgentConfig
from device_agent.agent.hooks import RuntimeHooks
from device_agent.agent.memory import MemoryHub, MemoryPort
from device_agent.agent.probe import probe_device
from device_agent.agent.runtime import Agent, AgentError
from device_agent.common.profile import DeviceProfile
from device_agent.emulation.batching import StepBatcher
from device_agent.emulation.slots import ComputeSlots
from device_agent.emulation.worker import MAX_BATCH_CPU
from device_agent.training.batched import DeviceTrainer, StepRunner
from device_agent.wire.messages import Assignment, Message, RoundFailed, encode
from device_agent.wire.payload import Received
from device_agent.wire.transfer import DEFAULT_CHUNK_SIZE, new_transfer_id

log = logging.getLogger("fedfleet.memory")

Split = tuple[Tensor, Tensor]
HEARTBEAT_S = 2.0
"""An in-memory device's status interval: a heartbeat costs nothing here, and a lost one is noticed sooner."""


@dataclass
class LocalDevice:
    """One in-process device: its id and its data shards, already shaped for the fleet's model."""

    device_id: str
    train: Split
    test: Split
    samples: int | None = field(default=None, init=False)

    def for_model(self, image_size: int, in_channels: int, num_classes: int) -> tuple[Split, Split]:
        return self.train, self.test


class Turns:
    """Devices train one at a time, in the order their assignments were sent: a simulation gives the same
    model for the same seeds (the upload gate's bound learns from each accepted update in arrival order).

    A device's turn starts when it is at the head and its round's work begins, and ends when its update (or
    its failure) reaches the engine. A head that does not start within ``patience_s`` (an assignment its agent
    ignores: a repeat of a round it already answered) loses its turn, so nobody waits for it for long.
    """

    def __init__(self, patience_s: float = 2.0) -> None:
        self.patience_s = patience_s
        self._queue: deque[str] = deque()
        self._started: set[str] = set()
        self._changed = threading.Condition()

    def assigned(self, device: str) -> None:
        with self._changed:
            if device not in self._queue:
                self._queue.append(device)
                self._changed.notify_all()

    def wait(self, device: str) -> None:
        """Block until ``device`` is at the head (or it was never queued: a test's own agent)."""
        with self._changed:
            while device in self._queue and self._queue[0] != device:
                head = self._queue[0]
                timed_out = not self._changed.wait(self.patience_s)
                if timed_out and self._queue and self._queue[0] == head and head not in self._started:
                    log.debug("%s did not start its turn within %.1f s; skipped", head, self.patience_s)
                    self._queue.popleft()
            self._started.add(device)

    def begin(self, device: str) -> None:
        """``device``'s round's work has begun though it waits for its turn later (before its upload)."""
        with self._changed:
            self._started.add(device)

    def answered(self, device: str) -> None:
        with self._changed:
            if device in self._queue:
                self._queue.remove(device)
            self._started.discard(device)
            self._changed.notify_all()


class TakingTurns(RuntimeHooks):
    """A device's hooks: its round's work waits for its turn.

    With a ``batcher`` the devices' rounds run at once instead, their training steps batched
    (:mod:`device_agent.emulation.batching`), and only the uploads take turns: the engine still receives them
    in the order it assigned the rounds.
    """

    def __init__(self, turns: Turns, device: str, batcher: StepBatcher | None = None) -> None:
        self.turns, self.device, self.batcher = turns, device, batcher
        self._started = 0.0

    def memory_guard(self) -> AbstractContextManager[object]:
        if self.batcher is None:
            self.turns.wait(self.device)
        else:
            self.turns.begin(self.device)
            self._started = time.monotonic()
        return nullcontext()

    def step_batcher(self) -> StepRunner | None:
        return None if self.batcher is None else self._step

    def _step(self, trainer: DeviceTrainer, step: int) -> float:
        assert self.batcher is not None
        return self.batcher.step(trainer, step, self._started)

    def before_upload(self) -> None:
        if self.batcher is not None:
            self.turns.wait(self.device)


@dataclass(frozen=True)
class Described:
    """What :meth:`MemoryLink.prepare` makes: nothing to hash ahead, the bytes are handed over whole."""

    fields: dict[str, Any]


@functools.cache
def _probed(torch_device: str) -> DeviceProfile:
    """This host's profile, probed once per process: every in-memory device reports it (planning is fixed)."""
    return probe_device(0.2, torch_device)


class MemoryLink:
    """The Link of devices in this process; every device is online from :meth:`start` on."""

    def __init__(
        self,
        devices: Sequence[LocalDevice],
        fleet: str = "simulation",
        torch_device: str = "cpu",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        profile: DeviceProfile | None = None,
        batch: bool = False,
    ) -> None:
        """``batch``: the devices' rounds run at once, their training steps batched (see :class:`TakingTurns`)."""
        self.devices = {d.device_id: d for d in devices}
        self.batcher = StepBatcher(ComputeSlots(1), max_batch=MAX_BATCH_CPU) if batch else None
        self.fleet, self.torch_device = fleet, torch_device
        self.hub = MemoryHub(chunk_size)
        self.profile = profile
        self.errors: dict[str, str] = {}
        self.turns = Turns()
        self._up: Counter[str] = Counter()
        self._down: Counter[str] = Counter()
        self._delivered: dict[str, float] = {}
        self._agents: list[Agent] = []
        self._threads: list[threading.Thread] = []
        self._state: tempfile.TemporaryDirectory[str] | None = None

    def start(
        self, on_message: MessageHandler, on_payload: PayloadHandler, on_refused: RefusalHandler | None = None
    ) -> None:
        """Attach the engine, then start one agent per device. The hub refuses nothing: ``on_refused`` is unused."""

        def message_in(device: str, message: Message) -> None:
            self._up[device] += len(encode(message))
            on_message(device, message)
            if isinstance(message, RoundFailed):
                self.turns.answered(device)

        def payload_in(device: str, received: Received) -> None:
            self._up[device] += received.size or 0
            on_payload(device, received)
            self.turns.answered(device)

        self.hub.attach_coordinator(message_in, payload_in)
        self._state = tempfile.TemporaryDirectory(prefix="fedfleet-devices-")
        profile = self.profile or _probed(self.torch_device)
        for device in self.devices.values():
            agent = self.agent(device, profile, Path(self._state.name) / device.device_id)
            thread = threading.Thread(target=self._serve, args=(agent,), name=f"agent-{device.device_id}", daemon=True)
            self._agents.append(agent)
            self._threads.append(thread)
            thread.start()

    def agent(self, device: LocalDevice, profile: DeviceProfile, state: Path) -> Agent:
        """The real device runtime for ``device``, on this link's hub (a test may make its agents otherwise)."""
        config = AgentConfig(
            device=device.device_id,
            fleet=self.fleet,
            device_type=self.torch_device,
            state_dir=state,
            heartbeat_s=HEARTBEAT_S,
        )
        return Agent(
            config,
            profile,
            TakingTurns(self.turns, device.device_id, self.batcher),
            MemoryPort(self.hub, device.device_id),
            device,
        )

    def _serve(self, agent: Agent) -> None:
        try:
            agent.run()
        except (AgentError, Exception) as exc:  # one device's failure is the engine's to notice (it goes offline)
            self.errors[agent.config.device] = f"{type(exc).__name__}: {exc}"
            log.exception("%s: the in-memory agent stopped", agent.config.device)

    def stop(self) -> None:
        for agent in self._agents:
            agent.stop()
        for thread in self._threads:
            thread.join()
        self.hub.detach_coordinator()
        self._agents, self._threads = [], []
        if self._state is not None:
            self._state.cleanup()
            self._state = None

    def send_control(self, device: str, message: Message) -> None:
        self._down[device] += len(encode(message))
        if isinstance(message, Assignment):  # queued first: the agent may start at once
            self.turns.assigned(device)
        if not self.hub.to_device(device, message) and isinstance(message, Assignment):
            self.turns.answered(device)

    def prepare(self, payload: bytes, **fields: Any) -> Described:
        return Described(fields)

    def send_payload(self, device: str, payload: bytes, outgoing: Any) -> str:
        transfer = new_transfer_id()
        self._down[device] += len(payload)
        if self.hub.payload_to_device(device, transfer, payload):
            self._delivered[device] = time.monotonic()
        return transfer

    def payload_in_flight(self, device: str) -> bool:
        """Payloads are handed over at once in process."""
        return False

    def delivered_ago(self, device: str) -> float | None:
        delivered = self._delivered.get(device)
        return None if delivered is None else time.monotonic() - delivered

    def close_round(self, round_: int) -> None:
        """Nothing travels here: an agent drops a closed round's update when the next round's assignment comes."""

    def bytes_up(self, device: str) -> int:
        return self._up[device]

    def bytes_down(self, device: str) -> int:
        return self._down[device]


__all__ = ["LocalDevice", "MemoryLink", "TakingTurns", "Turns"]
