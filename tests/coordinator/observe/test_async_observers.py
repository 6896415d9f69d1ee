"""Async mode's observers: the snapshot (status page), Prometheus, the live table and the report show model
versions, updates per version and the staleness histogram, and agree with metrics.jsonl."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from coordinator.cli.live import round_table
from coordinator.observe.prometheus import RunCollector
from coordinator.observe.snapshot import FleetWatch
from coordinator.run.report import write_report
from tests.coordinator.rounds.async_engines import async_engine

VERSIONS = 3


def test_versions_updates_and_staleness_reach_every_observer(tmp_path: Path) -> None:
    engine = async_engine(tmp_path, ["a", "b", "c", "d"], VERSIONS, {"buffer": 2, "max_staleness": 3})
    watch = FleetWatch(engine.rundir.metrics())
    assert engine.run(watch.update)
    watch.update(engine)
    versions = engine.rundir.metrics()
    staleness: Counter[int] = Counter()
    for version in versions:
        staleness.update(version.asynchronous.staleness)

    snapshot = watch.snapshot
    assert snapshot is not None and snapshot.asynchronous is not None
    view = snapshot.asynchronous
    assert (view.version, view.buffer, view.max_staleness) == (VERSIONS, 2, 3)
    assert view.staleness == dict(sorted(staleness.items())) and sum(view.staleness.values()) == 2 * VERSIONS
    assert [row.updates for row in snapshot.history] == [2] * VERSIONS
    assert snapshot.as_json()["asynchronous"]["version"] == VERSIONS  # what the status page reads

    registry = CollectorRegistry()
    registry.register(RunCollector(lambda: watch.snapshot))
    text = generate_latest(registry).decode()
    assert f"fedfleet_model_version {VERSIONS}.0" in text
    assert "fedfleet_async_version_updates 2.0" in text
    assert f"fedfleet_async_update_staleness_count {2 * VERSIONS}.0" in text
    zero = float(re.search(r'fedfleet_async_update_staleness_bucket\{le="0"\} (\S+)', text).group(1))
    assert zero == staleness[0]
    assert re.search(r"fedfleet_async_updates_too_stale_total 0\.0", text)

    console = Console(width=200, record=True)
    console.print(round_table(engine))
    table = console.export_text()
    assert f"version {VERSIONS}/{VERSIONS}" in table and "staleness" in table and "trains version" in table

    report = write_report(engine.rundir.path).read_text()
    assert "Staleness (async)" in report and f"{VERSIONS} model versions, {2 * VERSIONS} updates folded" in report
    assert "<th>version</th>" in report and "<th>updates</th>" in report
