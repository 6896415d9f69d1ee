"""What the engine says about devices that cannot take part: once, with the reason, and not forever."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from coordinator.cli.live import round_table
from coordinator.config.fleet import parse_fleet
from coordinator.planning.planner import DevicePlan
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.data.datasets import LabeledData
from device_agent.wire.messages import Hello, Status, incompatible
from tests.device_agent.agent.test_misconfiguration import PROFILE

FLEET = {
    "fleet": "waiting",
    "transport": {"broker": {"mode": "managed"}},
    "model": {"arch": "cnn", "num_classes": 10, "in_channels": 1, "image_size": 8},
    "dataset": {"name": "digits"},
    "ratios": [1],
    "devices": [{"id": "laptop-01", "profile": "rtx-4060-laptop"}],
}
TOO_SLOW = "excluded: round takes ~217 s > deadline 60 s"


def _nobody_fits(fleet, _catalog, _reports, _ceilings) -> list[DevicePlan]:
    return [DevicePlan(d.id, d.profile, None, None, None, None, None, 217.0, 60.0, TOO_SLOW) for d in fleet.devices]


def idle_engine(tmp_path: Path, wait_timeout_s: float, fleet: dict = FLEET, min_devices: int = 1) -> RoundEngine:
    """An engine over one in-process device, laptop-01, that no plan lets take part."""
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8))
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    x, y = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
    return RoundEngine(
        parse_fleet(fleet),
        {},
        strategy,
        rundir,
        LabeledData(x, y, x, y, 10),
        MemoryLink([LocalDevice("laptop-01", (x, y), (x, y))]),
        EngineSettings(min_devices=min_devices, wait_timeout_s=wait_timeout_s),
        planner=_nobody_fits,
    )


@pytest.mark.slow
def test_waiting_for_a_participant_is_logged_once_and_times_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = idle_engine(tmp_path, wait_timeout_s=1.5)
    caplog.set_level(logging.INFO, logger="fedfleet.engine")
    try:
        with pytest.raises(TimeoutError, match="round 1: no device could take part within 2 s"):
            engine.run()
    finally:
        engine.rundir.close()

    waits = [r.getMessage() for r in caplog.records if "no online device can take part" in r.getMessage()]
    assert waits == [f"round 1: no online device can take part (laptop-01: {TOO_SLOW}); waiting up to 2 s"]
    assert sum("laptop-01 out" in r.getMessage() for r in caplog.records) == 1


def test_a_device_of_another_protocol_version_is_refused_with_why_until_it_says_hello(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = idle_engine(tmp_path, wait_timeout_s=1)
    caplog.set_level(logging.WARNING, logger="fedfleet.engine")
    try:
        for _ in range(3):
            engine._on_message("laptop-01", incompatible(4))
        refused = engine.devices["laptop-01"]
        assert refused.refused == incompatible(4).detail and not refused.online
        assert [r.getMessage() for r in caplog.records] == [f"laptop-01: refused: {incompatible(4).detail}"]
        console = Console(record=True, width=200)
        console.print(round_table(engine))
        assert "refused" in console.export_text()

        engine._on_message("laptop-01", Hello(device="laptop-01", agent_version="0.1.0", profile=PROFILE))
        assert refused.refused is None and not refused.online  # a retained hello alone may be a crashed agent's
        engine._on_message("laptop-01", Status(device="laptop-01", state="idle"))
        assert refused.online
    finally:
        engine.rundir.close()


def test_an_agent_of_another_release_is_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = idle_engine(tmp_path, wait_timeout_s=1)
    caplog.set_level(logging.WARNING, logger="fedfleet.engine")
    try:
        for _ in range(2):
            engine._on_message("laptop-01", Hello(device="laptop-01", agent_version="0.9.2", profile=PROFILE))
    finally:
        engine.rundir.close()

    releases = [r.getMessage() for r in caplog.records if "another release" in r.getMessage()]
    assert len(releases) == 1 and releases[0].startswith("laptop-01: agent 0.9.2 is another release")


def test_giving_up_on_devices_names_the_ones_that_never_came(tmp_path: Path) -> None:
    fleet = {**FLEET, "devices": [*FLEET["devices"], {"id": "pi5-01", "profile": "raspberry-pi-5"}]}
    engine = idle_engine(tmp_path, wait_timeout_s=0.5, fleet=fleet, min_devices=2)
    try:
        with pytest.raises(
            TimeoutError, match=r"only 1 of the 2 devices .* \(offline: pi5-01; .* `device-agent doctor`\)"
        ):
            engine.run()
    finally:
        engine.rundir.close()


def test_a_flood_of_events_cannot_hold_the_loop_past_a_tick(tmp_path: Path) -> None:
    engine = idle_engine(tmp_path, wait_timeout_s=5)
    flooding = threading.Event()

    def flood() -> None:
        while not flooding.is_set():
            engine._events.put(lambda: None)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        engine._pump(started + 30, lambda _e: None)
        took = time.monotonic() - started
    finally:
        flooding.set()
        thread.join()
        engine.rundir.close()
    assert took < 1.0, f"the loop applied events for {took:.1f} s before looking at the round again"


def _comes_online(engine: RoundEngine, device: str) -> None:
    engine._on_message(device, Hello(device=device, agent_version="0.1.0", profile=PROFILE))
    engine._on_message(device, Status(device=device, state="idle"))


def test_round_one_waits_a_moment_for_the_rest_of_the_fleet(tmp_path: Path) -> None:
    """The quorum is online; a device that connects moments later still makes round 1 (no settle wait when all are)."""
    fleet = {**FLEET, "devices": [*FLEET["devices"], {"id": "pi5-01", "profile": "raspberry-pi-5"}]}
    (tmp_path / "late").mkdir()
    engine = idle_engine(tmp_path / "late", wait_timeout_s=30, fleet=fleet, min_devices=1)
    try:
        _comes_online(engine, "laptop-01")
        threading.Timer(0.3, lambda: engine._events.put(lambda: _comes_online(engine, "pi5-01"))).start()
        started = time.monotonic()
        assert engine._wait_for_devices(lambda _e: None)
        assert sorted(engine.roster.online()) == ["laptop-01", "pi5-01"]
        assert time.monotonic() - started < engine.settings.settle_s
    finally:
        engine.rundir.close()
    (tmp_path / "alone").mkdir()
    engine = idle_engine(tmp_path / "alone", wait_timeout_s=30, fleet=fleet, min_devices=1)
    try:
        _comes_online(engine, "laptop-01")
        started = time.monotonic()
        assert engine._wait_for_devices(lambda _e: None)
        assert engine.settings.settle_s <= time.monotonic() - started < engine.settings.settle_s + 1
        assert list(engine.roster.online()) == ["laptop-01"]
    finally:
        engine.rundir.close()
