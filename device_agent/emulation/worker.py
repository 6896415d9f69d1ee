"""One worker process hosting many emulated devices: the real agent runtime, once per virtual device.

A process per device costs a Python + torch runtime each (~300-370 MB), so a host runs a few dozen.
A worker imports torch once and runs one :class:`device_agent.agent.runtime.Agent` per device, each in
its own thread with everything a device has of its own: MQTT session and client id, login, state
directory, data shard, outbox, link shaping and step pacing. The code path is the agent's own:
only the hooks differ (:class:`device_agent.emulation.limits.EmulatedDevice` with a compute slot). Devices
take turns computing in the worker's compute slots (the earliest-started device first,
:mod:`device_agent.emulation.slots`) and sleep off their device time outside them,
so while device A waits to hold its step time, device B trains. Memory is held per device by
accounting (:mod:`device_agent.emulation.accounting`), since no OS cap exists per thread.

A worker reads a list of agent.yaml files (``device-agent worker --agents LIST``), which is what
``coordinator emulate`` and ``device-agent emulate`` write when they pack devices
(:mod:`device_agent.emulation.packing`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch
import yaml

from device_agent.agent.config import AgentConfig, ConfigError, EmulationConfig, load_config
from device_agent.agent.probe import probe_device, resolve_device
from device_agent.agent.runtime import Agent, AgentError
from device_agent.agent.stopping import stop_on_signals
from device_agent.common.profile import DeviceProfile
from device_agent.data.datasets import DatasetError, check_source
from device_agent.emulation.batching import StepBatcher
from device_agent.emulation.limits import EmulatedDevice, limit_threads
from device_agent.emulation.packing import MAX_DEVICES_PER_WORKER, WORKER_LIMIT_REASON
from device_agent.emulation.slots import ComputeSlots

log = logging.getLogger("fedfleet.worker")

MAX_BATCH_CPU = 32
"""Steps in one batched step on a CPU worker: K=32 of the 8 px CNN at width 1/4 cost 0.44x their steps one by one
(2 shared cores, 2026-11-29); past ~64 full-width steps the activations outgrow the caches and cost more."""
MAX_BATCH_CUDA = 256
"""On a GPU a batched step is launch-bound far longer; 256 steps of the scale benchmark's CNN hold ~100 MiB."""

BATCH_BY_DEFAULT = {"cuda": True, "cpu": False}
"""Whether a worker batches steps unless told: on CPU the scale benchmark's 300 devices ran 35 of 1,800 steps batched
(earliest-first slots let devices' steps seldom queue together), 139 against 133 CPU-s one by one, and the first
batched step imports torch's compiler stack (~78 MiB a worker; 2026-11-29). A GPU step is launch-bound: batching
is what it needs (untested: no GPU was lent)."""

HEAP_REUSE_BYTES = 16 * 2**20
"""Tensors up to this size are served from glibc's heap once one of this size was freed (:func:`reuse_freed_memory`)."""

STAGGER_S = 0.02
"""Pause between two devices' first connects: hundreds at once make the broker refuse some (backlog)."""


def reuse_freed_memory(nbytes: int = HEAP_REUSE_BYTES) -> None:
    """Free one ``nbytes`` tensor, so glibc keeps freed tensors up to that size in its heap for the next ones.

    glibc maps each allocation above its mmap threshold (128 KiB at start) afresh and unmaps it when freed, and
    freeing such a mapping raises the threshold to its size. Without that, every activation of a device's
    evaluation or step is a new mapping whose pages fault in: a device-round loop of the scale benchmark's CNN
    (14 px, one thread) took 1.1-1.2 s of system CPU and ~500,000 minor faults without, 0.05 s and ~18,000 with,
    user CPU the same (5.1-5.3 s; 2026-11-29). The host probe's buffers used to do this by the way.
    """
    freed = torch.empty(nbytes, dtype=torch.uint8)
    del freed


def read_agent_list(path: Path) -> list[AgentConfig]:
    """The agent.yaml files a worker hosts: a YAML list of paths, relative ones to the list's folder."""
    try:
        entries = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
        raise ConfigError(f"{path}: expected a non-empty list of agent.yaml paths")
    if len(entries) > MAX_DEVICES_PER_WORKER:
        raise ConfigError(
            f"{path}: {len(entries)} devices, more than the {MAX_DEVICES_PER_WORKER} one worker can hold "
            f"({WORKER_LIMIT_REASON})"
        )
    configs = [load_config(Path(path).parent / entry) for entry in entries]
    devices = [config.device for config in configs]
    repeated = sorted({d for d in devices if devices.count(d) > 1})
    if repeated:
        raise ConfigError(f"{path}: device(s) listed twice: {', '.join(repeated)}")
    types = {config.device_type for config in configs}
    if len(types) > 1:
        raise ConfigError(f"{path}: one worker trains on one device type, got {', '.join(sorted(types))}")
    return configs


class Worker:
    """Many virtual devices in this process; :meth:`run` serves them until :meth:`stop`.

    ``slots``: how many devices compute at once (each with the process's ``threads``); one keeps a
    device's step timing and its measured CUDA peak its own. ``batch``: devices' training steps of one key
    run together where that is cheaper (:mod:`device_agent.emulation.batching`), at most ``max_batch`` at once;
    None: on CUDA only (:data:`BATCH_BY_DEFAULT`).
    """

    def __init__(
        self,
        configs: list[AgentConfig],
        *,
        slots: int = 1,
        threads: int = 1,
        profile: DeviceProfile | None = None,
        batch: bool | None = None,
        max_batch: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not configs:
            raise ValueError("a worker needs at least one device")
        limit_threads(threads)
        device = resolve_device(configs[0].device_type)
        # On a GPU every thread that computes holds its own cuBLAS/cuDNN handle and workspace: only the slots' do.
        self.slot = ComputeSlots(slots, own_threads=device.type == "cuda")
        largest = max_batch or (MAX_BATCH_CUDA if device.type == "cuda" else MAX_BATCH_CPU)
        batched = BATCH_BY_DEFAULT.get(device.type, False) if batch is None else batch
        self.batcher = StepBatcher(self.slot, largest) if batched else None
        # Measured once: every device's hooks replace what emulation holds them to (compute, memory, link). Devices
        # paced in device time all report their profile's compute: then the host's is not benchmarked at all.
        computes = [config.emulation.compute if config.emulation else None for config in configs]
        given = computes[0] if all(compute is not None for compute in computes) else None
        measured = profile or probe_device(0.2, configs[0].device_type, compute=given)
        reuse_freed_memory()
        self.agents = [
            Agent(
                config,
                measured,
                hooks=EmulatedDevice(config.emulation or EmulationConfig(), device, self.slot, self.batcher),
            )
            for config in configs
        ]
        self.errors: dict[str, str] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def run(self, stagger_s: float = STAGGER_S) -> None:
        """Start every device (connects staggered), serve until :meth:`stop` or a device fails, stop them all."""
        for agent in self.agents:
            if self._stopping.is_set():
                break
            thread = threading.Thread(target=self._serve, args=(agent,), name=f"agent-{agent.config.device}")
            thread.start()
            self._threads.append(thread)
            time.sleep(stagger_s)
        while not self._stopping.wait(0.5):
            pass
        for agent in self.agents:
            agent.stop()
        for thread in self._threads:
            thread.join()
        self.slot.close()

    def stop(self) -> None:
        self._stopping.set()

    def _serve(self, agent: Agent) -> None:
        try:
            agent.run()
        except AgentError as exc:
            self.errors[agent.config.device] = str(exc)
            log.error("%s: %s; stopping this worker", agent.config.device, exc)
        except Exception as exc:
            self.errors[agent.config.device] = f"{type(exc).__name__}: {exc}"
            log.exception("%s: crashed; stopping this worker", agent.config.device)
        if not self._stopping.is_set() and agent.config.device in self.errors:
            self.stop()


def run_worker(agent_list: Path, slots: int = 1, threads: int = 1, batch: bool | None = None) -> int:
    """``device-agent worker``: serve the listed devices until SIGINT/SIGTERM; 1 if one of them failed."""
    configs = read_agent_list(agent_list)
    for config in configs:
        try:
            check_source(config.data.source)
        except DatasetError as exc:
            raise AgentError(f"{config.device}: {exc}") from None
    worker = Worker(configs, slots=slots, threads=threads, batch=batch)
    stop_on_signals(worker.stop)
    how = f"steps batched, up to {worker.batcher.max_batch}" if worker.batcher else "steps one by one"
    log.info("worker: %d devices (%s .. %s), %s", len(configs), configs[0].device, configs[-1].device, how)
    worker.run()
    if worker.batcher is not None:
        log.info(
            "worker: %d training steps ran batched, %d one by one",
            worker.batcher.batched_steps,
            worker.batcher.single_steps,
        )
    for device, error in worker.errors.items():
        log.error("%s failed: %s", device, error)
    return 1 if worker.errors else 0
