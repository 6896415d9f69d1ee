"""A consistent, thread-safe picture of a running engine for the metrics exporter and the status page.

The engine owns its state on one thread and takes no locks. :meth:`FleetWatch.update` runs on that
thread (as ``engine.run``'s progress callback), copies what the observers need into plain frozen
records and swaps them in under a lock; the HTTP threads only ever read the latest copy. Totals per
device are summed from closed rounds (the same records ``metrics.jsonl`` holds, so a scrape and the
file agree round for round); refusals and out-of-memory step-downs are the engine's own counters.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from coordinator.rounds.engine import Refusal
from coordinator.run.metrics import RoundMetrics

if TYPE_CHECKING:
    from coordinator.rounds.engine import RoundEngine

STRAGGLER_STATUSES = ("late", "dropped")
"""A selected device whose update did not arrive in time: it missed the deadline or went offline."""


@dataclass
class DeviceTotals:
    """One device over the closed rounds of the run (resumed rounds included)."""

    bytes_up: int = 0
    bytes_down: int = 0
    train_seconds: float = 0.0
    host_seconds: float = 0.0
    selected: int = 0
    """Rounds it was drawn into: what its refusal and clip rates are rates of."""
    accepted: int = 0
    clipped: int = 0
    """Accepted updates clipped to the update bound (an honest device clipped often: the bound is too tight)."""
    last_round: int | None = None
    last_status: str | None = None


@dataclass(frozen=True)
class DeviceView:
    id: str
    device_class: str
    online: bool
    refused_because: str | None
    """Why the coordinator will not work with the device at all (another protocol version), until its next hello."""
    agent_state: str
    ratio: float | None
    """The level the device trains in the open round, else the planner's latest choice for it."""
    round_status: str | None
    totals: DeviceTotals
    refused: dict[str, int]
    """Refused uploads by reason."""
    step_downs: int
    missed_in_a_row: int = 0
    """Rounds it was drawn into and missed or was refused in, in a row (0 once an update is accepted)."""
    backoffs: int = 0
    """Times it was set to sit out rounds for missing them (``limits.backoff_after``)."""
    sits_out_until: int | None = None
    """The last round it sits out, while it is backing off."""


@dataclass(frozen=True)
class RoundView:
    """One closed round, as plotted and exported."""

    round: int
    accuracy: float | None
    loss: float | None
    federated_accuracy: float | None
    federated_loss: float | None
    personalized_accuracy: float | None
    participants: int
    selected: int
    stragglers: int
    bytes_up: int
    bytes_down: int
    seconds: float
    phases: dict[str, float]
    epsilon: float | None = None
    """User-level epsilon after this round (fleet.yaml ``privacy``), at ``delta``; None without privacy."""
    delta: float | None = None
    updates: int | None = None
    """Async mode (the round is a model version): the updates folded into it; None in rounds."""
    staleness: dict[int, int] | None = None
    """Async mode: staleness -> this version's updates."""
    too_stale: int = 0
    """Async mode: updates refused as too stale since the version before."""

    @classmethod
    def of(cls, metrics: RoundMetrics) -> RoundView:
        statuses = Counter(d.status for d in metrics.devices.values())
        a = metrics.asynchronous
        return cls(
            round=metrics.round,
            accuracy=metrics.accuracy,
            loss=metrics.loss,
            federated_accuracy=metrics.federated_accuracy,
            federated_loss=metrics.federated_loss,
            personalized_accuracy=metrics.personalized_accuracy,
            participants=metrics.participants,
            selected=len(metrics.devices),
            stragglers=sum(statuses[s] for s in STRAGGLER_STATUSES),
            bytes_up=metrics.bytes_up,
            bytes_down=metrics.bytes_down,
            seconds=metrics.seconds,
            phases=dict(metrics.phases),
            epsilon=None if metrics.privacy is None else metrics.privacy.epsilon,
            delta=None if metrics.privacy is None else metrics.privacy.delta,
            updates=None if a is None else a.updates,
            staleness=None if a is None else dict(a.staleness),
            too_stale=0 if a is None else a.too_stale,
        )


@dataclass(frozen=True)
class OpenRoundView:
    round: int
    elapsed_s: float
    deadline_in_s: float
    selected: int
    statuses: dict[str, int]


@dataclass(frozen=True)
class AsyncView:
    """Async mode (fleet.yaml ``strategy.mode: async``): where FedBuff stands now, and the run's staleness."""

    version: int
    """The newest published model version."""
    buffered: int
    """Updates folded toward the next version."""
    buffer: int
    """Updates that make a version (``async.buffer``, K)."""
    training: int
    """Devices holding an assignment they have not answered."""
    concurrency: int | None
    max_staleness: int
    staleness: dict[int, int]
    """Staleness -> updates folded into the run's published versions (a resumed run's included)."""
    too_stale: int
    """Updates refused as too stale over the run's published versions."""


@dataclass(frozen=True)
class Snapshot:
    fleet: str
    run_id: str
    rounds_planned: int
    next_round: int
    taken: float
    devices: list[DeviceView]
    open_round: OpenRoundView | None
    history: list[RoundView]
    refusals: list[Refusal]
    """The engine's last refused uploads, oldest first."""
    quorum: float = 1.0
    """fleet.yaml's quorum: a round with fewer accepted updates than this share of its selected devices failed."""
    asynchronous: AsyncView | None = None
    """Async mode only: model versions instead of rounds (``history`` holds one row per version)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class FleetWatch:
    """Folds closed rounds into per-device totals and keeps the latest :class:`Snapshot` for readers."""

    def __init__(self, history: list[RoundMetrics]) -> None:
        self._totals: dict[str, DeviceTotals] = {}
        self._history: list[RoundView] = []
        for metrics in history:
            self._fold(metrics)
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None

    @property
    def snapshot(self) -> Snapshot | None:
        """The latest copy, or None before the engine's first progress tick."""
        with self._lock:
            return self._snapshot

    def update(self, engine: RoundEngine) -> None:
        """The engine's progress callback: runs on the engine's thread, so reading its state is safe here."""
        last = engine.last
        if last is not None and (not self._history or last.round > self._history[-1].round):
            self._fold(last)
        snapshot = Snapshot(
            fleet=engine.fleet.fleet,
            run_id=engine.rundir.run_id,
            rounds_planned=engine.fleet.rounds,
            next_round=engine.next_round,
            taken=time.time(),
            devices=self._devices(engine),
            open_round=self._open_round(engine),
            history=list(self._history),
            refusals=list(engine.recent_refusals),
            quorum=engine.fleet.quorum,
            asynchronous=self._async(engine),
        )
        with self._lock:
            self._snapshot = snapshot

    def _fold(self, metrics: RoundMetrics) -> None:
        self._history.append(RoundView.of(metrics))
        for device, m in metrics.devices.items():
            totals = self._totals.setdefault(device, DeviceTotals())
            totals.bytes_up += m.bytes_up
            totals.bytes_down += m.bytes_down
            totals.train_seconds += m.train_seconds or 0.0
            totals.host_seconds += m.host_seconds or 0.0
            totals.selected += 1
            totals.accepted += m.status == "accepted"
            totals.clipped += m.clipped is not None
            totals.last_round, totals.last_status = metrics.round, m.status

    def _devices(self, engine: RoundEngine) -> list[DeviceView]:
        open_ = engine.open
        refused: dict[str, dict[str, int]] = {}
        for (device, reason), count in engine.refusals.items():
            refused.setdefault(device, {})[reason] = count
        views = []
        for device_id, state in engine.devices.items():
            participant = open_.participants.get(device_id) if open_ else None
            plan = engine.plans.get(device_id)
            if participant is not None:
                ratio: float | None = participant.trained_level or participant.level
            else:
                ratio = plan.ratio if plan is not None else None
            totals = self._totals.get(device_id, DeviceTotals())
            views.append(
                DeviceView(
                    id=device_id,
                    device_class=state.device.profile,
                    online=state.online,
                    refused_because=state.refused,
                    agent_state=state.state,
                    ratio=None if ratio is None else float(ratio),
                    round_status=participant.status if participant else None,
                    totals=DeviceTotals(**asdict(totals)),
                    refused=refused.get(device_id, {}),
                    step_downs=engine.step_downs[device_id],
                    missed_in_a_row=engine.backoff.missed[device_id],
                    backoffs=engine.backoff.backoffs[device_id],
                    sits_out_until=engine.backoff.sits_out_until(device_id, engine.next_round),
                )
            )
        return views

    def _async(self, engine: RoundEngine) -> AsyncView | None:
        if not getattr(engine, "runs_async", False):
            return None
        server = engine.server  # type: ignore[attr-defined]
        staleness: Counter[int] = Counter()
        for row in self._history:
            staleness.update(row.staleness or {})
        return AsyncView(
            version=server.version,
            buffered=server.buffered,
            buffer=server.settings.buffer,
            training=len(server.in_flight),
            concurrency=server.settings.concurrency,
            max_staleness=server.settings.max_staleness,
            staleness=dict(sorted(staleness.items())),
            too_stale=sum(row.too_stale for row in self._history),
        )

    @staticmethod
    def _open_round(engine: RoundEngine) -> OpenRoundView | None:
        open_ = engine.open
        if open_ is None:
            return None
        now = time.monotonic()
        return OpenRoundView(
            round=open_.round,
            elapsed_s=now - open_.started,
            deadline_in_s=open_.deadline - now,
            selected=len(open_.participants),
            statuses=dict(Counter(p.status for p in open_.participants.values())),
        )
