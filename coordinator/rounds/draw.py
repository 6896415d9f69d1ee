"""Who trains in a round, at which level: the plan for every online device, then a seeded draw."""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Mapping

from coordinator.config.fleet import Fleet
from coordinator.planning.planner import DevicePlan, after_out_of_memory, fmt_ratio
from coordinator.rounds.backoff import Backoff
from coordinator.rounds.roster import Roster
from coordinator.run.rundir import RunDir
from device_agent.common.profile import DeviceProfile
from profiles.schema import DeviceClass

log = logging.getLogger("fedfleet.engine")

Planner = Callable[
    [Fleet, Mapping[str, DeviceClass], Mapping[str, DeviceProfile], Mapping[str, float]], list[DevicePlan]
]
"""Who trains at which level: :func:`~coordinator.planning.planner.plan_fleet` for a fleet; fixed in a simulation."""


LIST_UP_TO = 20
"""Fleets up to this size get every device's part in the round's plan line; larger ones a summary."""


class ParticipantDraw:
    """Plans every device, draws ``participation`` of the eligible ones, and steps devices down after OOM.

    A device backing off (:mod:`~coordinator.rounds.backoff`: it missed rounds in a row) is not eligible while it
    sits out, unless every eligible device is backing off.
    """

    def __init__(self, fleet: Fleet, planner: Planner, rundir: RunDir) -> None:
        self.fleet = fleet
        self.planner = planner
        self.rundir = rundir
        self.plans: dict[str, DevicePlan] = {}
        self.ceilings: dict[str, float] = {}
        self.step_downs: Counter[str] = Counter()
        self.backoff = Backoff(fleet.limits.backoff_after, fleet.limits.backoff_max_rounds, rundir.metrics())
        self.population = 0
        """How many devices the last fresh draw chose from (the eligible ones): the privacy accountant's n."""
        self._last_plan: tuple[int, str] | None = None

    def draw(self, round_: int, roster: Roster) -> list[tuple[str, float]]:
        """(device, level) of the round: the saved choice when resuming it, else a fresh plan and draw."""
        saved = self.rundir.saved_participants(round_)
        if saved is not None:
            return [(d, level) for d, level in saved.items() if d in roster.devices]
        self.plans = {p.device: p for p in self.planner(self.fleet, roster.catalog, roster.profiles(), self.ceilings)}
        planned = sorted(d for d in roster.online() if self.plans[d].ratio is not None)
        sitting_out = self.backoff.sitting_out(round_) & set(planned)
        eligible = [d for d in planned if d not in sitting_out] or planned
        self.population = len(eligible)
        count = math.ceil(self.fleet.participation * len(eligible))
        chosen = random.Random(self.rundir.seed * 1_000_003 + round_).sample(eligible, count)
        self._log_plan(round_, roster, chosen, sitting_out if eligible is not planned else set())
        return [(d, float(self.plans[d].ratio)) for d in sorted(chosen)]  # type: ignore[arg-type]

    def out_of_memory(self, device: str, level: float) -> None:
        """The device ran out of memory at ``level``: plan it below that from now on."""
        self.step_downs[device] += 1
        self.ceilings = after_out_of_memory(self.ceilings, device, level, self.fleet.ratios)

    def _log_plan(self, round_: int, roster: Roster, chosen: list[str], sitting_out: set[str]) -> None:
        """Why each fleet device is in or out of the round: a device that never takes part must say why."""
        parts = []
        for device, state in roster.devices.items():
            plan = self.plans[device]
            if device in chosen:
                parts.append(f"{device} at {fmt_ratio(plan.ratio)}")  # type: ignore[arg-type]
            elif not state.online:
                parts.append(f"{device} out (offline)")
            elif plan.ratio is None:
                parts.append(f"{device} out ({plan.reason})")
            elif device in sitting_out:
                parts.append(f"{device} out (backing off)")
            else:
                parts.append(f"{device} out (not drawn)")
        line = "; ".join(parts) if len(parts) <= LIST_UP_TO else summarize_plan(parts)
        if (round_, line) != self._last_plan:  # re-planned while waiting: say it again only if it changed
            log.info("round %d: %s", round_, line)
        self._last_plan = (round_, line)


def summarize_plan(parts: list[str]) -> str:
    """A large fleet's plan in one readable line: devices counted per level, those left out named per reason."""
    groups: dict[str, list[str]] = {}
    for part in parts:
        device, _, what = part.partition(" ")
        groups.setdefault(what, []).append(device)
    out = []
    for what, devices in sorted(groups.items(), key=lambda item: (item[0].startswith("out"), item[0])):
        named = "" if what.startswith("at") else ": " + ", ".join(devices[:5]) + (" ..." if len(devices) > 5 else "")
        out.append(f"{len(devices)} {what}{named}")
    return f"{len(parts)} devices: " + "; ".join(out)


__all__ = ["ParticipantDraw", "Planner"]
