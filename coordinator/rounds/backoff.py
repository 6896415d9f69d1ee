"""Devices that keep missing rounds are drawn less: they sit out rounds, longer after each further miss.

A device drawn into a round that does not answer it (late, dropped, failed) or whose update is refused has
missed it. After ``after`` misses in a row it sits out the next round; each further miss doubles that, up to
``most`` rounds. It comes back by itself, and one accepted update clears its count. The counts are rebuilt
from ``metrics.jsonl`` on resume, so a restart changes nothing, and they are reported: the status page,
``fedfleet_device_missed_rounds`` and the run's report.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from coordinator.run.metrics import RoundMetrics

log = logging.getLogger("fedfleet.engine")


class Backoff:
    """Misses in a row per device, and the round through which each backed-off device sits out."""

    def __init__(self, after: int, most: int, history: Iterable[RoundMetrics] = ()) -> None:
        """``after``: misses in a row before a device sits out (0: never); ``history``: the run's closed rounds."""
        self.after = after
        self.most = most
        self.missed: Counter[str] = Counter()
        """Rounds missed in a row, per device (0 once it answers)."""
        self.backoffs: Counter[str] = Counter()
        """How many times each device was set to sit out, over the run."""
        self.until: dict[str, int] = {}
        """The last round each backed-off device sits out."""
        for metrics in history:
            self.record(metrics, quiet=True)

    def record(self, metrics: RoundMetrics, quiet: bool = False) -> None:
        """Count a closed round's misses; a device at ``after`` misses or more sits out the rounds after it."""
        for device, m in metrics.devices.items():
            if m.status == "accepted":
                self.missed[device] = 0
                self.until.pop(device, None)
                continue
            self.missed[device] += 1
            if not self.after or self.missed[device] < self.after:
                continue
            rounds = min(2 ** (self.missed[device] - self.after), self.most)
            self.until[device] = metrics.round + rounds
            self.backoffs[device] += 1
            first, last = metrics.round + 1, metrics.round + rounds
            if not quiet:
                log.warning(
                    "%s missed %d rounds in a row (round %d: %s); it sits out %s",
                    device,
                    self.missed[device],
                    metrics.round,
                    m.reason or m.status,
                    f"round {first}" if rounds == 1 else f"rounds {first}-{last}",
                )

    def sits_out_until(self, device: str, round_: int) -> int | None:
        """The last round ``device`` sits out, if it sits out ``round_``; else None."""
        last = self.until.get(device)
        return last if last is not None and round_ <= last else None

    def sitting_out(self, round_: int) -> set[str]:
        """Devices that sit out ``round_``."""
        return {device for device, last in self.until.items() if round_ <= last}


__all__ = ["Backoff"]
