"""FleetWatch: what the engine did, copied on the engine's thread, agrees with metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from coordinator.observe.snapshot import FleetWatch, RoundView
from coordinator.run.metrics import RoundMetrics
from device_agent.wire.messages import Hello, Status, incompatible
from tests.coordinator.observe.conftest import ROUNDS, WatchedRun
from tests.coordinator.rounds.test_engine_diagnostics import idle_engine
from tests.device_agent.agent.test_misconfiguration import PROFILE


def test_history_and_device_totals_are_the_closed_rounds_of_metrics_jsonl(watched_run: WatchedRun) -> None:
    snapshot = watched_run.watch.snapshot
    assert snapshot is not None
    assert [r.round for r in snapshot.history] == list(range(1, ROUNDS + 1))
    assert snapshot.history == [RoundView.of(m) for m in watched_run.metrics]
    for device in snapshot.devices:
        rows = [m.devices[device.id] for m in watched_run.metrics]
        assert device.totals.bytes_up == sum(r.bytes_up for r in rows) > 0
        assert device.totals.bytes_down == sum(r.bytes_down for r in rows) > 0
        assert device.totals.accepted == sum(r.status == "accepted" for r in rows)
        assert device.totals.last_round == ROUNDS
    good = next(d for d in snapshot.devices if d.id == "good")
    assert (good.ratio, good.totals.accepted, good.refused) == (0.5, ROUNDS, {})


def test_refused_uploads_are_counted_by_reason_and_kept_with_their_detail(watched_run: WatchedRun) -> None:
    snapshot = watched_run.watch.snapshot
    assert snapshot is not None
    bad = next(d for d in snapshot.devices if d.id == "bad")
    assert bad.refused == {"bad_meta": ROUNDS}
    assert bad.totals.accepted == 0 and bad.totals.last_status == "rejected"
    assert [(r.device, r.round, r.reason) for r in snapshot.refusals] == [("bad", n, "bad_meta") for n in (1, 2)]
    assert all("loss=nan" in r.detail for r in snapshot.refusals)
    assert all(r.participants == 1 and r.selected == 2 and r.stragglers == 0 for r in snapshot.history)


def test_a_resumed_run_starts_from_the_rounds_already_in_metrics_jsonl(watched_run: WatchedRun) -> None:
    earlier: list[RoundMetrics] = watched_run.metrics[:1]
    watch = FleetWatch(earlier)
    assert watch.snapshot is None  # nothing to show before the engine's first tick
    watch.update(watched_run.engine)  # the engine's last round (2) is new to this watch: folded once
    watch.update(watched_run.engine)
    snapshot = watch.snapshot
    assert snapshot is not None and [r.round for r in snapshot.history] == [1, 2]
    good = next(d for d in snapshot.devices if d.id == "good")
    assert good.totals.bytes_up == sum(m.devices["good"].bytes_up for m in watched_run.metrics)


def test_a_device_of_another_protocol_version_shows_as_refused_with_why_until_it_says_hello(tmp_path: Path) -> None:
    engine = idle_engine(tmp_path, wait_timeout_s=1)
    watch = FleetWatch([])
    try:
        engine._on_message("laptop-01", incompatible(4))
        watch.update(engine)
        snapshot = watch.snapshot
        assert snapshot is not None
        [device] = snapshot.as_json()["devices"]
        assert (device["refused_because"], device["online"]) == (incompatible(4).detail, False)

        engine._on_message("laptop-01", Hello(device="laptop-01", agent_version="0.1.0", profile=PROFILE))
        engine._on_message("laptop-01", Status(device="laptop-01", state="idle"))  # what an agent sends after its hello
        watch.update(engine)
        snapshot = watch.snapshot
        assert snapshot is not None
        assert (snapshot.devices[0].refused_because, snapshot.devices[0].online) == (None, True)
    finally:
        engine.rundir.close()
