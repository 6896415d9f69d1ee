"""FedBuff's durable side: every acknowledged update survives a kill -9 of the coordinator, none is folded twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.rounds import async_ledger
from coordinator.strategies import ClientSlot
from device_agent.wire.codec import decode_tensors, encode_tensors
from tests.coordinator.rounds.fedbuff_process import SETTINGS, ledger_on, metrics_of, update
from tests.paths import REPO_ROOT


def acks_then_kill(run: Path, count: int) -> list[tuple[str, int]]:
    """Run the FedBuff process on ``run`` until it acknowledged ``count`` updates, then SIGKILL it mid-work."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.coordinator.rounds.fedbuff_process", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    acked = []
    try:
        while len(acked) < count:
            line = child.stdout.readline()
            assert line, f"the process exited ({child.wait()}) after {len(acked)} acknowledgements"
            _, device, ticket, status = line.split()
            if status == "accepted":
                acked.append((device, int(ticket)))
    finally:
        child.kill()  # SIGKILL: no handler, no flush, wherever it is
        child.wait()
    return acked


def test_a_coordinator_killed_twice_mid_run_loses_no_acknowledged_update_and_folds_none_twice(tmp_path) -> None:
    run = tmp_path / "run"
    acked = acks_then_kill(run, 10) + acks_then_kill(run, 8)  # the second process resumes the first's run
    rundir, ledger = ledger_on(run)
    try:
        assert {ticket for _, ticket in acked} <= ledger.folded
        committed = sum(m.participants for m in rundir.metrics())
        replayed = len(ledger.replayed.updates) if ledger.replayed is not None else 0
        assert committed + replayed + ledger.server.buffered == len(ledger.folded)  # each folded exactly once
        assert len(acked) <= len(ledger.folded) <= len(acked) + 2  # at most one journaled, unacknowledged per kill
        assert [m.round for m in rundir.metrics()] == list(range(1, rundir.last_completed_round + 1))
        assert all(m.participants == SETTINGS.buffer for m in rundir.metrics())
    finally:
        rundir.close()


def test_a_resumed_ledger_answers_a_retransmission_duplicate_and_refuses_a_superseded_ticket(tmp_path) -> None:
    run = tmp_path / "run"
    rundir, ledger = ledger_on(run)
    ticket, sent = ledger.assign(ClientSlot("d0", 1.0, 50))
    data = update(sent.tensors, ticket.number)
    assert ledger.accept("d0", ticket.number, "t1", data, 50) == ("accepted", None)
    old, sent = ledger.assign(ClientSlot("d0", 1.0, 50))
    newer, _ = ledger.assign(ClientSlot("d0", 1.0, 50))
    rundir.close()
    rundir, ledger = ledger_on(run)  # the process died with one update journaled toward version 1
    try:
        assert ledger.server.buffered == 1 and ticket.number in ledger.folded
        assert ledger.accept("d0", ticket.number, "t1", data, 50) == ("duplicate", None)  # its receipt was lost
        with pytest.raises(UpdateRejected, match=f"ticket {old.number} was superseded by ticket {newer.number}"):
            ledger.accept("d0", old.number, "t2", update(sent.tensors, old.number), 50)
        with pytest.raises(UpdateRejected, match="not an assignment of this device"):
            ledger.accept("d1", newer.number, "t3", data, 50)
    finally:
        rundir.close()


def test_a_version_the_journal_filled_before_the_crash_is_published_again_identically(tmp_path) -> None:
    run = tmp_path / "run"
    rundir, ledger = ledger_on(run)
    published = None
    for number, device in enumerate(["d0", "d1", "d2"]):
        ticket, sent = ledger.assign(ClientSlot(device, 1.0, 50))
        _, published = ledger.accept(device, ticket.number, f"t{number}", update(sent.tensors, ticket.number), 50)
    assert published is not None and published.version == 1
    expected = ledger.server.strategy.global_state()
    rundir.close()  # died before the commit
    rundir, ledger = ledger_on(run)
    try:
        assert ledger.replayed is not None and ledger.version == 1
        for key, value in expected.items():
            torch.testing.assert_close(ledger.server.strategy.global_state()[key], value)
        ledger.commit(ledger.replayed, metrics_of(1, 3))
        assert rundir.last_completed_round == 1
    finally:
        rundir.close()


def test_a_torn_last_log_line_is_cut_off_and_the_next_append_starts_clean(tmp_path) -> None:
    run = tmp_path / "run"
    rundir, ledger = ledger_on(run)
    first, _ = ledger.assign(ClientSlot("d0", 1.0, 50))
    rundir.close()
    with open(run / "async" / "tickets.jsonl", "a") as log:
        log.write('{"number": 2, "dev')  # the process died mid-append: that assignment never left
    rundir, ledger = ledger_on(run)
    try:
        assert list(ledger.tickets) == [first.number]
        again, _ = ledger.assign(ClientSlot("d1", 1.0, 50))
        assert again.number == first.number + 1 and (run / "async" / "tickets.jsonl").read_text().count("\n") == 2
    finally:
        rundir.close()


def test_an_update_off_its_contract_is_refused_from_its_header_and_nothing_is_journaled(tmp_path, monkeypatch) -> None:
    rundir, ledger = ledger_on(tmp_path / "run")
    try:
        ticket, sent = ledger.assign(ClientSlot("d0", 1.0, 50))
        tensors = decode_tensors(update(sent.tensors, ticket.number))
        wrong = encode_tensors({**tensors, "fc.weight": torch.zeros(3, 3)})
        monkeypatch.setattr(async_ledger, "decode_tensors", lambda data: pytest.fail("decoded before the header"))
        with pytest.raises(UpdateRejected, match=r"'fc.weight': shape \(3, 3\), expected") as refused:
            ledger.accept("d0", ticket.number, "t1", wrong, 50)
        assert refused.value.reason == "bad_shape" and not ledger.folded and rundir.resume().journal == []
    finally:
        rundir.close()
