"""Prometheus metrics of a run, read from the latest :class:`~coordinator.observe.snapshot.Snapshot`.

A custom collector renders the snapshot at scrape time, so a scrape is one consistent moment of the
engine and nothing is double-booked between the engine's thread and the scraper's. Labels stay
bounded: ``device`` and ``device_class`` come from fleet.yaml, ``reason`` from the engine's short
refusal codes, ``phase`` from the round's fixed phases. Totals span the run's closed rounds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.observe.snapshot import AsyncView, DeviceView, Snapshot
from coordinator.planning.planner import fmt_ratio

PREFIX = "fedfleet_"

# (name without prefix, help, value of one device) for the per-device families, summed per class.
_DEVICE_COUNTERS: list[tuple[str, str, Callable[[DeviceView], float]]] = [
    ("upload_bytes", "bytes the device sent in closed rounds (payload plus protocol)", lambda d: d.totals.bytes_up),
    ("download_bytes", "bytes sent to the device in closed rounds", lambda d: d.totals.bytes_down),
    ("train_seconds", "local training time as the device spent it (emulation: held to its profile)",
     lambda d: d.totals.train_seconds),
    ("host_train_seconds", "emulated devices: the part of train seconds the host computed",
     lambda d: d.totals.host_seconds),
    ("rounds_selected", "closed rounds the device was drawn into", lambda d: d.totals.selected),
    ("uploads_accepted", "updates folded into a closed round", lambda d: d.totals.accepted),
    ("uploads_clipped", "accepted updates clipped to the update bound", lambda d: d.totals.clipped),
    ("oom_step_downs", "out-of-memory failures that made the planner step the device down a level",
     lambda d: d.step_downs),
    ("backoffs", "times the device was set to sit out rounds after missing limits.backoff_after in a row",
     lambda d: d.backoffs),
]  # fmt: skip


class RunCollector(Collector):
    """Yields the ``fedfleet_*`` families of the latest snapshot (none before the engine's first tick)."""

    def __init__(self, snapshot: Callable[[], Snapshot | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        if snapshot is None:
            return
        yield from _device_families(snapshot.devices)
        yield from _class_families(snapshot.devices)
        yield from _round_families(snapshot)
        if snapshot.asynchronous is not None:
            yield from _async_families(snapshot.asynchronous, snapshot)


def _device_families(devices: list[DeviceView]) -> Iterator[Metric]:
    labels = ["device", "device_class"]
    online = GaugeMetricFamily(f"{PREFIX}device_online", "1 while the device's agent is connected", labels=labels)
    ratio = GaugeMetricFamily(
        f"{PREFIX}device_rank_ratio",
        "rank ratio (level) the device trains in the open round, else the planner's latest choice",
        labels=labels,
    )
    refused = CounterMetricFamily(
        f"{PREFIX}device_uploads_refused", "uploads refused at the gate, by reason", labels=[*labels, "reason"]
    )
    missed = GaugeMetricFamily(
        f"{PREFIX}device_missed_rounds",
        "rounds in a row the device was drawn into and missed or was refused in (0 once an update is accepted)",
        labels=labels,
    )
    for device in devices:
        key = [device.id, device.device_class]
        online.add_metric(key, float(device.online))
        missed.add_metric(key, device.missed_in_a_row)
        if device.ratio is not None:
            ratio.add_metric(key, device.ratio)
        for reason, count in sorted(device.refused.items()):
            refused.add_metric([*key, reason], count)
    yield from (online, ratio, refused, missed)
    for name, help_, value in _DEVICE_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}device_{name}", help_, labels=labels)
        for device in devices:
            family.add_metric([device.id, device.device_class], value(device))
        yield family


def _class_families(devices: list[DeviceView]) -> Iterator[Metric]:
    by_class: dict[str, list[DeviceView]] = defaultdict(list)
    for device in devices:
        by_class[device.device_class].append(device)
    count = GaugeMetricFamily(f"{PREFIX}class_devices", "devices of the class in the fleet", labels=["device_class"])
    online = GaugeMetricFamily(f"{PREFIX}class_devices_online", "devices of the class online", labels=["device_class"])
    refused = CounterMetricFamily(
        f"{PREFIX}class_uploads_refused", "uploads refused at the gate, by reason", labels=["device_class", "reason"]
    )
    for name, members in sorted(by_class.items()):
        count.add_metric([name], len(members))
        online.add_metric([name], sum(d.online for d in members))
        reasons: dict[str, int] = defaultdict(int)
        for device in members:
            for reason, n in device.refused.items():
                reasons[reason] += n
        for reason, n in sorted(reasons.items()):
            refused.add_metric([name, reason], n)
    at_ratio = GaugeMetricFamily(
        f"{PREFIX}class_devices_at_rank_ratio",
        "devices of the class per rank ratio they train or were last planned at (ratios are fleet.yaml's levels)",
        labels=["device_class", "rank_ratio"],
    )
    for name, members in sorted(by_class.items()):
        levels = Counter(fmt_ratio(d.ratio) for d in members if d.ratio is not None)
        for level, n in sorted(levels.items()):
            at_ratio.add_metric([name, level], n)
    yield from (count, online, refused, at_ratio)
    for metric, help_, value in _DEVICE_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}class_{metric}", help_, labels=["device_class"])
        for name, members in sorted(by_class.items()):
            family.add_metric([name], sum(value(d) for d in members))
        yield family


def _round_families(snapshot: Snapshot) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        f"{PREFIX}rounds_planned", "rounds the run is configured for", value=snapshot.rounds_planned
    )
    yield CounterMetricFamily(f"{PREFIX}rounds_completed", "closed rounds", value=len(snapshot.history))
    open_ = snapshot.open_round
    yield GaugeMetricFamily(
        f"{PREFIX}open_round", "the round now open (0 between rounds)", value=open_.round if open_ else 0
    )
    open_selected = GaugeMetricFamily(
        f"{PREFIX}open_round_devices", "devices selected for the open round, by status", labels=["status"]
    )
    for status, n in sorted((open_.statuses if open_ else {}).items()):
        open_selected.add_metric([status], n)
    yield open_selected
    if not snapshot.history:
        return
    last = snapshot.history[-1]
    last_round = "the last closed round's"
    yield GaugeMetricFamily(f"{PREFIX}round_last_completed", "number of the last closed round", value=last.round)
    yield GaugeMetricFamily(f"{PREFIX}round_duration_seconds", f"{last_round} wall time", value=last.seconds)
    phases = GaugeMetricFamily(f"{PREFIX}round_phase_seconds", f"{last_round} wall time by phase", labels=["phase"])
    for phase, seconds in sorted(last.phases.items()):
        phases.add_metric([phase], seconds)
    yield phases
    yield GaugeMetricFamily(f"{PREFIX}round_participants", f"{last_round} accepted updates", value=last.participants)
    yield GaugeMetricFamily(f"{PREFIX}round_selected_devices", f"{last_round} selected devices", value=last.selected)
    yield GaugeMetricFamily(
        f"{PREFIX}round_stragglers", f"{last_round} selected devices that were late or dropped", value=last.stragglers
    )
    if last.accuracy is not None and last.loss is not None:
        yield GaugeMetricFamily(
            f"{PREFIX}round_accuracy_ratio", f"{last_round} global test accuracy (0-1)", value=last.accuracy
        )
        yield GaugeMetricFamily(f"{PREFIX}round_loss", f"{last_round} global test loss", value=last.loss)
    if last.epsilon is not None:
        yield GaugeMetricFamily(
            f"{PREFIX}privacy_epsilon",
            "user-level epsilon after the last closed round, at fleet.yaml's privacy.delta (dp-accounting RDP)",
            value=last.epsilon,
        )
    if last.federated_accuracy is not None and last.federated_loss is not None:
        received = "federated evaluation of the model the devices received"
        yield GaugeMetricFamily(
            f"{PREFIX}round_federated_accuracy_ratio", f"{last_round} {received} (0-1)", value=last.federated_accuracy
        )
        yield GaugeMetricFamily(
            f"{PREFIX}round_federated_loss", f"{last_round} {received}: loss", value=last.federated_loss
        )


STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
"""Upper bounds of the staleness histogram's buckets (versions); fleet.yaml's max_staleness is 20 by default."""


def _async_families(view: AsyncView, snapshot: Snapshot) -> Iterator[Metric]:
    """Async mode (docs/async.md): model versions, updates per version and the staleness of folded updates."""
    yield GaugeMetricFamily(f"{PREFIX}model_version", "the newest published model version", value=view.version)
    yield GaugeMetricFamily(
        f"{PREFIX}async_buffered_updates",
        "updates folded toward the next version (it is published at the buffer)",
        value=view.buffered,
    )
    yield GaugeMetricFamily(f"{PREFIX}async_buffer_size", "updates that make a version (async.buffer, K)", view.buffer)
    yield GaugeMetricFamily(
        f"{PREFIX}async_devices_training", "devices holding an assignment they have not answered", value=view.training
    )
    newest = snapshot.history[-1].updates if snapshot.history else None
    if newest is not None:
        yield GaugeMetricFamily(f"{PREFIX}async_version_updates", "updates folded into the newest version", newest)
    yield CounterMetricFamily(
        f"{PREFIX}async_updates_too_stale",
        "updates refused as too stale (async.max_staleness) in published versions",
        value=view.too_stale,
    )
    cumulative = [(str(bound), sum(n for s, n in view.staleness.items() if s <= bound)) for bound in STALENESS_BUCKETS]
    total = sum(view.staleness.values())
    yield HistogramMetricFamily(
        f"{PREFIX}async_update_staleness",
        "versions published while a folded update trained, over the run's published versions",
        buckets=[*cumulative, ("+Inf", total)],
        sum_value=sum(s * n for s, n in view.staleness.items()),
    )
