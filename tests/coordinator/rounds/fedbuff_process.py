"""A coordinator process that runs FedBuff on a run directory until it is killed: the kill -9 test's subject.

    python -m tests.coordinator.rounds.fedbuff_process RUN_DIR

Four devices answer in turn (their updates are the model they were sent, moved by a seeded step); every update is
checked, journaled, folded and then acknowledged with a line ``ack DEVICE TICKET`` on stdout, as a receipt would
be sent; each published version is committed. Started on an existing run directory it resumes it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from coordinator.config.asynchronous import AsyncSettings
from coordinator.rounds.async_ledger import AsyncLedger
from coordinator.run.metrics import RoundMetrics
from coordinator.run.rundir import RunDir
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.clients.base import is_norm_statistic
from device_agent.wire.codec import encode_tensors

SPEC = ModelSpec("cnn", 10, 1, 8)
SETTINGS = AsyncSettings(buffer=3, max_staleness=4)
DEVICES = ("d0", "d1", "d2", "d3")


def ledger_on(path: Path) -> tuple[RunDir, AsyncLedger]:
    strategy = build_strategy("fedavg", SPEC, seed=0)
    if (path / "run.json").exists():
        rundir = RunDir.open(path)
    else:
        fleet = path.parent / "fleet.yaml"
        fleet.write_text("fleet: kill9\n")
        rundir = RunDir.create(path, fleet, strategy.state_dict(), seed=0)
    return rundir, AsyncLedger(rundir, strategy, SETTINGS)


def metrics_of(version: int, updates: int) -> RoundMetrics:
    return RoundMetrics(round=version, participants=updates, bytes_up=0, bytes_down=0, seconds=0)


def update(sent: dict[str, torch.Tensor], ticket: int) -> bytes:
    generator = torch.Generator().manual_seed(ticket)
    moved = {
        k: v + 0.01 * torch.randn(v.shape, generator=generator)
        for k, v in sent.items()
        if v.is_floating_point() and not is_norm_statistic(k)
    }
    return encode_tensors(moved)


def main(path: Path) -> None:
    _, ledger = ledger_on(path)
    if ledger.replayed is not None:
        ledger.commit(ledger.replayed, metrics_of(ledger.replayed.version, len(ledger.replayed.updates)))
    held = {}
    for device in DEVICES:  # a resumed process re-sends each device its assignment: a new ticket
        held[device] = ledger.assign(ClientSlot(device, 1.0, 50))
    turn = 0
    while True:
        device = DEVICES[turn % len(DEVICES)]
        turn += 1
        ticket, assignment = held[device]
        status, published = ledger.accept(
            device, ticket.number, f"t{ticket.number}", update(assignment.tensors, ticket.number), 50
        )
        print(f"ack {device} {ticket.number} {status}", flush=True)
        if published is not None:
            ledger.commit(published, metrics_of(published.version, len(published.updates)))
        held[device] = ledger.assign(ClientSlot(device, 1.0, 50))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
