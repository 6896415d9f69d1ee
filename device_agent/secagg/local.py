"""Every party of one protocol run in one process, messages passed through their wire form: for tests, the
benchmark and emulation, where devices and coordinator share a machine. ``drop`` says who stops answering
at which stage, the way a device that loses power mid-round does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from numpy.typing import ArrayLike

from device_agent.secagg.auth import HmacAuth
from device_agent.secagg.device import DeviceProtocol
from device_agent.secagg.messages import Message, Params, Session, decode, encode
from device_agent.secagg.server import Aggregate, ServerProtocol

STAGES = ("advertise", "share_keys", "mask", "unmask")
"""The stages a device answers, in order: ``drop[stage]`` devices send nothing from that stage on."""
_T = TypeVar("_T")


@dataclass
class Costs:
    """Wire bytes each way per device, and seconds spent in each party's protocol code."""

    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    device_seconds: dict[str, float] = field(default_factory=dict)
    server_seconds: float = 0.0


class InProcessRun:
    """One run: ``run()`` drives it to its end; ``server`` and ``costs`` stay readable, also after an abort.

    ``keys``: per-device HMAC keys (each device holds its own, the server all); ``drop[stage]``: the devices
    that send nothing from that stage on; ``clip``: devices clamp inputs to the quantization range.
    """

    def __init__(
        self,
        session: Session,
        params: Params,
        inputs: Mapping[str, ArrayLike],
        drop: Mapping[str, Collection[str]] | None = None,
        keys: Mapping[str, bytes] | None = None,
        clip: bool = False,
    ) -> None:
        self.clip = clip
        self.drop = {stage: frozenset(devices) for stage, devices in (drop or {}).items()}
        unknown = set(self.drop) - set(STAGES)
        if unknown:
            raise ValueError(f"drop: unknown stages {sorted(unknown)}; stages are {STAGES}")
        self.inputs = inputs
        self.costs = Costs()
        self.server = ServerProtocol(session, params, HmacAuth(keys) if keys else None)
        self.devices = {
            device: DeviceProtocol(device, HmacAuth({device: keys[device]}) if keys else None)
            for device in params.participants
        }

    def run(self) -> Aggregate:
        """The aggregate of the survivors (``ProtocolAborted`` if the run cannot finish)."""
        costs, server, gone = self.costs, self.server, set()
        outgoing: list[Message] = self._timed_server(server.start)
        for stage in STAGES:
            gone |= self.drop.get(stage, frozenset())
            for message in outgoing:
                device = message.device
                if device in gone:
                    continue
                down = encode(message)
                costs.bytes_down[device] = costs.bytes_down.get(device, 0) + len(down)
                started = time.perf_counter()
                reply = self._answer(self.devices[device], stage, decode(down))
                costs.device_seconds[device] = costs.device_seconds.get(device, 0.0) + time.perf_counter() - started
                up = encode(reply)
                costs.bytes_up[device] = costs.bytes_up.get(device, 0) + len(up)
                self._timed_server(lambda up=up: server.receive(decode(up)))
            outgoing = self._timed_server(server.advance)
        assert server.result is not None
        return server.result

    def _answer(self, device: DeviceProtocol, stage: str, message: Message) -> Message:
        if stage == "advertise":
            return device.advertise(message)  # type: ignore[arg-type]
        if stage == "share_keys":
            return device.share_keys(message)  # type: ignore[arg-type]
        if stage == "mask":
            return device.mask(message, self.inputs[device.device], clip=self.clip)  # type: ignore[arg-type]
        return device.unmask(message)  # type: ignore[arg-type]

    def _timed_server(self, call: Callable[[], _T]) -> _T:
        started = time.perf_counter()
        try:
            return call()
        finally:
            self.costs.server_seconds += time.perf_counter() - started
