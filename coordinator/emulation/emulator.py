"""``coordinator emulate``: a whole fleet on one host, the real coordinator plus one real agent per device.

Every device of the fleet.yaml becomes a ``device-agent run`` process with its own agent.yaml in
``RUN_DIR/agents/<device>/``: held to its profile (after the fleet's per-device overrides) by the
limits of :mod:`device_agent.emulation.profile_config`, given shard ``index`` of ``count`` of the fleet's data set
(``dataset.partition`` and ``dataset.seed``; shards are disjoint and cover the training set) and
its own broker login, passed in its environment so no secret is written into its agent.yaml.
The coordinator is the same code as ``coordinator start``; only the agents are added, so a run
that works here works on a real fleet. Large fleets are packed into worker processes that run the
same agent once per device (:mod:`device_agent.emulation.packing`, :mod:`device_agent.emulation.worker`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from coordinator.config.fleet import REPORTED, Device, Fleet, Partition
from coordinator.planning.planner import effective_profile, level_cost, predict_level_memory
from coordinator.provision.layout import SIGNING_KEY
from coordinator.transport.broker.credentials import Credentials
from device_agent.common.profile import ComputeSpec
from device_agent.emulation.launcher import AgentExit, AgentGroup, AgentSpec, pack_specs, worker_command
from device_agent.emulation.packing import PACK_ABOVE, describe, pack
from device_agent.emulation.profile_config import (
    DataShare,
    EmulationLimits,
    ProfileSpec,
    agent_config,
    limits_for,
    password_env,
    write_agent_config,
)
from profiles.costmodel import Workload, predict_step_seconds
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.emulator")

AGENTS_DIR = "agents"
WORKERS_DIR = "workers"


class EmulatorError(ValueError):
    """A fleet that cannot be emulated; the message names the key path."""


def partition_text(partition: Partition) -> str:
    """fleet.yaml's partition as agent.yaml writes it (``dirichlet(0.5)``, ``domains(3)``, ``iid``...)."""
    return partition.text


def predicted_step_seconds(fleet: Fleet, device: Device, profile: DeviceClass) -> dict[float, float]:
    """Seconds of one training step of ``device`` at every level it may be assigned, as the planner predicts.

    The levels are the fleet's ratios and 1 (what a strategy without levels assigns); the model is
    the strategy's client model at that level, at the device's batch size and the fleet's optimizer.
    """
    batch = device.overrides.batch_size or fleet.training.batch_size
    levels = sorted({*fleet.ratios, 1.0})
    return {
        level: predict_step_seconds(Workload(level_cost(fleet, level).trace, batch, fleet.training.optimizer), profile)
        for level in levels
    }


def predicted_peak_bytes(fleet: Fleet, device: Device, profile: DeviceClass) -> dict[float, int]:
    """Peak memory of the agent over a round at every level it may be assigned, as the planner predicts it.

    A device packed into a worker has no OS memory cap of its own: it is held to these by accounting.
    """
    return {level: predict_level_memory(fleet, device, profile, level) for level in sorted({*fleet.ratios, 1.0})}


def device_limits(
    fleet: Fleet, catalog: Mapping[str, DeviceClass], host_gflops: float | None = None, threads: int = 1
) -> dict[str, EmulationLimits]:
    """Limits of every device, from its profile with the fleet's overrides applied (as the planner sees it).

    The compute pace is device time (each step held to the cost model's prediction for the profile)
    unless ``host_gflops`` is given: then the host ratio (each step stretched host / profile GFLOPS).
    """
    limits = {}
    for index, device in enumerate(fleet.devices):
        if device.profile == REPORTED:
            raise EmulatorError(
                f"devices[{index}].profile: {device.id} is '{REPORTED}', which has no profile to emulate; name one"
            )
        profile = effective_profile(device, catalog[device.profile], None)
        assert profile is not None  # a static profile is always there
        spec = ProfileSpec.model_validate(profile.model_dump())
        peaks = predicted_peak_bytes(fleet, device, profile)
        if host_gflops is not None:
            limits[device.id] = dataclasses.replace(limits_for(spec, host_gflops, threads), peak_bytes=peaks)
            continue
        limits[device.id] = dataclasses.replace(
            limits_for(spec, spec.compute.fp32_gflops, threads),  # slowdown 1: the step time paces instead
            step_seconds=predicted_step_seconds(fleet, device, profile),
            compute=ComputeSpec.model_validate(profile.compute.model_dump()),
            peak_bytes=peaks,
        )
    return limits


def write_agent_specs(
    fleet: Fleet,
    catalog: Mapping[str, DeviceClass],
    run_dir: Path,
    broker_url: str,
    passwords: Mapping[str, str],
    host_gflops: float | None = None,
    *,
    threads: int = 1,
    device_type: str = "cpu",
    ca_file: str | None = None,
    protocol: str = "5",
    kits: Path | None = None,
    packed: bool = False,
) -> list[AgentSpec]:
    """Write ``RUN_DIR/agents/<device>/agent.yaml`` for every device and return what to launch.

    ``passwords`` maps device id to its broker password; it reaches the agent as ``$FEDFLEET_PASSWORD``.
    ``host_gflops``: see :func:`device_limits` (None: device time).
    With the fleet's ``kits`` (``coordinator provision``), the agent reads its password, CA and client
    certificate from its own kit instead, exactly the files a real device gets. ``packed``: the agents
    will share worker processes, so each device's password gets a variable of its own.
    """
    missing = [device.id for device in fleet.devices if device.id not in passwords]
    if missing:
        raise EmulatorError(f"no broker credentials for device(s) {', '.join(missing)}")
    limits = device_limits(fleet, catalog, host_gflops, threads)
    dataset = fleet.dataset
    specs = []
    for index, device in enumerate(fleet.devices):
        folder = Path(run_dir) / AGENTS_DIR / device.id
        share = DataShare(
            dataset.name,
            partition_text(dataset.partition),
            dataset.seed,
            index,
            len(fleet.devices),
            None if dataset.path is None else str(dataset.path),
            fleet.sized_samples(device),
            fleet.evaluation.max_samples,
        )
        kit = None if kits is None else (kits / device.id).resolve()
        variable = password_env(index if packed else None)
        secure = broker_url.startswith("mqtts://") and kit is not None and (kit / "client.pem").exists()
        tls = kit_tls_files(kit) if secure else {}  # type: ignore[arg-type]
        config = agent_config(
            device.id,
            fleet.fleet,
            broker_url,
            share,
            (folder / "state").resolve(),
            limits[device.id],
            password=f"file:{kit / 'password'}" if kit is not None else f"env:{variable}",
            ca_file=tls.get("ca_file", ca_file),
            cert_file=tls.get("cert_file"),
            key_file=tls.get("key_file"),
            protocol=protocol,
            device_type=device_type,
        )
        if kit is not None and (kit / SIGNING_KEY).exists():
            config["signing_key"] = f"file:{kit / SIGNING_KEY}"
        specs.append(
            AgentSpec(
                device.id,
                write_agent_config(folder / "agent.yaml", config),
                folder / "agent.log",
                threads,
                {} if kit is not None else {variable: passwords[device.id]},
            )
        )
    return specs


def kit_tls_files(kit: Path) -> dict[str, str]:
    """The CA and client certificate of a device's kit, as agent.yaml's broker keys."""
    return {"ca_file": str(kit / "ca.pem"), "cert_file": str(kit / "client.pem"), "key_file": str(kit / "client.key")}


def agent_url(broker_url: str) -> str:
    """Where local agents reach a broker listening on every interface (0.0.0.0 is no address to connect to)."""
    return broker_url.replace("://0.0.0.0:", "://127.0.0.1:", 1)


class Emulation:
    """The agent side of ``coordinator emulate``: launched once the coordinator's broker is up.

    Crashes are logged as they happen (with the end of the agent's log) and listed by :meth:`stop`.
    """

    def __init__(
        self,
        fleet: Fleet,
        catalog: Mapping[str, DeviceClass],
        host_gflops: float | None = None,
        *,
        threads: int = 1,
        device_type: str = "cpu",
        agents: AgentGroup | None = None,
        workers: int | None = None,
        devices_per_worker: int | None = None,
        pack_above: int = PACK_ABOVE,
        batch: bool | None = None,
    ) -> None:
        """``workers``, ``devices_per_worker``, ``pack_above``: how devices are spread over processes (packing.py);
        ``batch``: workers run their devices' steps of one model, level and batch shape together where cheaper
        (None: the workers' default, on CUDA only)."""
        device_limits(fleet, catalog, host_gflops, threads)  # fail before anything starts
        self.slices = pack(len(fleet.devices), workers, devices_per_worker, pack_above)
        self.fleet = fleet
        self.catalog = catalog
        self.host_gflops = host_gflops
        self.threads = threads
        self.device_type = device_type
        packed = AgentGroup(lambda agent_list: worker_command(agent_list, threads, batch)) if self.slices else None
        self.agents = agents or packed or AgentGroup()
        self.kits: Path | None = None  # the fleet's kits: agents take their secrets and certificates from them
        self.specs: list[AgentSpec] = []
        self.crashed: list[AgentExit] = []

    def launch(
        self, broker_url: str, credentials: Mapping[str, Credentials], run_dir: Path, protocol: str = "5"
    ) -> Callable[[], list[AgentExit]]:
        """Write every agent.yaml and start one agent per device; returns :meth:`stop`.

        ``protocol`` is the MQTT version the broker speaks; the agents are told to use it.

        This is ``coordinator start``'s ``on_broker_ready``: the agents stop before the broker does, so
        they leave it cleanly instead of losing it under their feet.
        """
        self.specs = write_agent_specs(
            self.fleet,
            self.catalog,
            run_dir,
            agent_url(broker_url),
            {name: c.password for name, c in credentials.items()},
            self.host_gflops,
            threads=self.threads,
            device_type=self.device_type,
            protocol=protocol,
            kits=self.kits,
            packed=self.slices is not None,
        )
        if self.slices is not None:
            self.specs = pack_specs(self.specs, self.slices, Path(run_dir) / AGENTS_DIR / WORKERS_DIR)
        for spec in self.specs:
            self.agents.start(spec)
        self.agents.watch(self._on_exit)
        pace = (
            "device time" if self.host_gflops is None else f"host ratio, host {self.host_gflops:.1f} GFLOPS per agent"
        )
        log.info(
            "%s started (%s); agent logs in %s",
            describe(len(self.fleet.devices), self.slices),
            pace,
            Path(run_dir) / AGENTS_DIR,
        )
        return self.stop

    def _on_exit(self, exit_: AgentExit) -> None:
        if exit_.crashed:
            self.crashed.append(exit_)
            log.error("emulated device crashed: %s", exit_.describe())
        else:
            log.warning("emulated device stopped on its own: %s", exit_.describe())

    def stop(self) -> list[AgentExit]:
        """Stop every agent cleanly (again is harmless); returns the agents that crashed during the run."""
        self.agents.stop()
        for device in self.agents.killed:
            log.warning("agent %s did not stop within the timeout and was killed", device)
        return self.crashed
