"""Async mode (FedBuff) end to end over real mosquitto: ``coordinator start`` and four ``device-agent run`` processes.

The coordinator is killed with SIGKILL after agents logged acknowledged updates and started again on the same run
directory: every update an agent saw acknowledged is folded (in a committed version or the open one's journal),
none twice, and the run publishes all its versions. An agent killed mid-run and started again on its state
directory comes back and contributes to a later version.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from coordinator.config.fleet import load_fleet
from coordinator.rounds.async_ledger import AsyncLedger
from coordinator.run.fleet_data import fleet_data
from coordinator.run.rundir import RunDir
from coordinator.strategies import build_strategy
from tests.e2e.test_engine_e2e import DEVICES, Fleet

pytestmark = pytest.mark.slow

ACKED = re.compile(r"round (\d+) update settled \(receipt: accepted\)")
VERSIONS = 8


def acknowledged(fleet: Fleet) -> dict[str, set[int]]:
    """Per agent, the tickets (the wire's round numbers) whose update it saw acknowledged, from its log."""
    return {
        d: {int(t) for t in ACKED.findall(log.read_text())} for d in DEVICES if (log := fleet.tmp / f"{d}.log").exists()
    }


@pytest.fixture
def async_fleet(tmp_path: Path):
    fleet = Fleet(tmp_path, rounds=VERSIONS, deadline_s=60)
    text = fleet.fleet_file.read_text().replace(
        "quorum: 0.75\n",
        "quorum: 0.75\nstrategy: {name: fedhm, mode: async, async: {buffer: 3, max_staleness: 6}}\n",
    )
    fleet.fleet_file.write_text(text)
    yield fleet
    fleet.close()


def test_async_run_survives_a_coordinator_kill_9_with_no_acknowledged_update_lost(async_fleet: Fleet) -> None:
    fleet = async_fleet
    coordinator = fleet.coordinator(min_devices=4)
    agents = {device: fleet.agent(device) for device in DEVICES}
    fleet.wait_for("5 acknowledged updates", lambda: sum(map(len, acknowledged(fleet).values())) >= 5, timeout=180)
    coordinator.send_signal(signal.SIGKILL)
    coordinator.wait()
    before = acknowledged(fleet)
    published_before = len(fleet.metrics())

    restarted = fleet.coordinator(min_devices=3)
    fleet.wait_for("a version after the restart", lambda: len(fleet.metrics()) > published_before, timeout=180)
    agents["d1"].send_signal(signal.SIGKILL)  # a device offline mid-run, then back on the same state directory
    agents["d1"].wait()
    back_at = len(fleet.metrics())
    d1_log = fleet.tmp / "d1.log"
    acks_before = len(ACKED.findall(d1_log.read_text()))
    # The other three are held while d1 starts again: on a loaded host (two busy loops) they published the run's
    # last versions before d1's new process had imported torch, and d1 never came back into a version.
    others = [agents[d] for d in DEVICES if d != "d1"]
    for agent in others:
        agent.send_signal(signal.SIGSTOP)
    try:
        agents["d1"] = fleet.agent("d1")
        fleet.wait_for(
            "d1's first acknowledged update after its restart",
            lambda: len(ACKED.findall(d1_log.read_text())) > acks_before,
            timeout=180,
        )
    finally:
        for agent in others:
            agent.send_signal(signal.SIGCONT)
    fleet.wait_for("the resumed run to finish", lambda: restarted.poll() is not None, timeout=300)

    log = (fleet.tmp / "coordinator.log").read_text()
    assert restarted.returncode == 0, log[-3000:]
    versions = fleet.metrics()
    assert [v["round"] for v in versions] == list(range(1, VERSIONS + 1))
    assert all(v["asynchronous"]["updates"] == 3 for v in versions)
    assert all(sum(v["asynchronous"]["staleness"].values()) == 3 for v in versions)
    assert any("d1" in v["devices"] for v in versions[back_at:]), "d1 did not come back after its restart"

    fleet_config, _ = load_fleet(fleet.fleet_file)
    spec, _ = fleet_data(fleet_config)
    strategy = build_strategy("fedhm", spec, fleet_config.strategy.params, seed=fleet_config.dataset.seed)
    rundir = RunDir.open(fleet.run_dir)
    try:
        ledger = AsyncLedger(rundir, strategy, fleet_config.strategy.asynchronous)
        acked = {ticket for tickets in before.values() for ticket in tickets}
        assert acked, "no update was acknowledged before the kill"
        assert acked <= ledger.folded, f"acknowledged before the kill but not folded: {sorted(acked - ledger.folded)}"
        replayed = len(ledger.replayed.updates) if ledger.replayed is not None else 0
        committed = sum(v["asynchronous"]["updates"] for v in versions)
        assert committed + replayed + ledger.server.buffered == len(ledger.folded)  # each folded exactly once
    finally:
        rundir.close()
    assert "resuming" in log
    assert versions[-1]["accuracy"] > 0.5
