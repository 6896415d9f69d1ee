"""The fleet's devices as the coordinator sees them: who is online, what each measured, who is refused."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from coordinator.config.fleet import Fleet
from coordinator.planning.steady_reports import SteadyReports
from coordinator.rounds.compatibility import release_note
from coordinator.rounds.state import DeviceState, Refusals, printable
from coordinator.rounds.upload_gate import profile_problem
from device_agent.common.profile import DeviceProfile
from device_agent.wire.messages import Hello, Status
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.engine")


class Roster:
    """Applies hello and status messages; the broker-authenticated topic names the sender."""

    def __init__(self, fleet: Fleet, catalog: Mapping[str, DeviceClass], refusals: Refusals) -> None:
        self.devices = {d.id: DeviceState(d) for d in fleet.devices}
        self.catalog = catalog
        self.reports = SteadyReports()
        self._refusals = refusals

    def online(self) -> list[str]:
        return [d for d, state in self.devices.items() if state.online]

    def profiles(self) -> dict[str, DeviceProfile]:
        """The measured reports the planner sizes devices from."""
        return {d: state.profile for d, state in self.devices.items() if state.profile is not None}

    def hello(self, device: str, message: Hello) -> None:
        state = self.devices[device]
        if message.device != device:
            self.wrong_sender(device, f"a hello as {message.device!r}")
            return
        problem = profile_problem(message.profile)
        if problem is not None:
            log.warning("%s sent a hello with %s; ignored (bad_message)", device, problem)
            self._refusals.count(device, "bad_message")
            return
        state.profile = self.reports.adopt(device, message.profile, self.catalog.get(state.device.profile))
        log.info(
            "%s: hello from agent %s (%s, %.2f GFLOPS measured)",
            device,
            message.agent_version,
            message.profile.accelerator,
            message.profile.compute.fp32_gflops,
        )
        note = release_note(message.agent_version)
        if note is not None and state.agent_version != message.agent_version:
            log.warning("%s: %s", device, note)
        # Not online by itself: a hello is retained, and one a crashed agent left beside its will's offline status
        # would count it online whichever the broker delivered last. The status the agent sends after it says so.
        state.agent_version, state.refused = message.agent_version, None

    def status(self, device: str, message: Status) -> bool:
        """Apply a status; False when it names another device (and is ignored)."""
        if message.device != device:
            self.wrong_sender(device, f"a status naming {message.device!r}")
            return False
        state = self.devices[device]
        state.state = message.state
        self.set_online(state, message.state != "offline", f"{message.state} {printable(message.detail)}".strip())
        return True

    def incompatible(self, device: str, detail: str) -> None:
        """The agent speaks another protocol version: offline for the coordinator until it says hello again."""
        state = self.devices[device]
        if state.refused != detail:
            log.warning("%s: refused: %s", device, detail)
        state.refused = detail
        self.set_online(state, False, "incompatible")

    def wrong_sender(self, device: str, what: str) -> None:
        """A message whose content contradicts its topic's device (the broker-authenticated sender)."""
        log.warning("%s sent %s; ignored (wrong_sender)", device, what)
        self._refusals.count(device, "wrong_sender")

    @staticmethod
    def set_online(state: DeviceState, online: bool, why: str) -> None:
        if online != state.online:
            log.info("%s: %s (%s)", state.device.id, "online" if online else "offline", why)
        state.online = online


__all__ = ["Roster"]
