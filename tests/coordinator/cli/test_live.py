"""The live table: its title shows whichever figures a round has (the server's, the devices' federated ones, both);
a device's row starts the same in the round view and the version view (async mode)."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from coordinator.cli.live import round_figures, round_table
from coordinator.config.fleet import Device
from coordinator.rounds.async_ledger import Ticket
from coordinator.rounds.state import DeviceState, Participant
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics


def closed_round(**figures: float) -> RoundMetrics:
    device = DeviceRoundMetrics(
        device_class="raspberry-pi-5",
        ratio=1.0,
        bytes_up=1,
        bytes_down=1,
        payload_bytes=1,
        status="accepted",
        global_accuracy=figures.get("federated_accuracy"),
        global_loss=figures.get("federated_loss"),
        eval_samples=40 if "federated_accuracy" in figures else None,
    )
    return RoundMetrics(
        round=1, participants=1, bytes_up=1, bytes_down=1, seconds=1.0, devices={"pi": device}, **figures
    )


def test_a_coordinator_with_and_without_data_shows_what_it_measured() -> None:
    both = closed_round(accuracy=0.9, loss=0.3, federated_accuracy=0.85, federated_loss=0.4)
    assert round_figures(both) == "accuracy 0.900, loss 0.300, federated accuracy 0.850"
    assert round_figures(closed_round(federated_accuracy=0.85, federated_loss=0.4)) == "federated accuracy 0.850"
    assert round_figures(closed_round()) == "not evaluated"


DEVICES = {
    "pi": DeviceState(Device(id="pi", profile="raspberry-pi-5"), online=True, state="training"),
    "orin": DeviceState(Device(id="orin", profile="jetson-orin-nano-8gb"), online=True, state="idle"),
    "old": DeviceState(Device(id="old", profile="raspberry-pi-4"), refused="protocol 1"),
}


def rows(engine: SimpleNamespace) -> dict[str, list[str]]:
    """The table's body rows as their cells' text, by device."""
    console = Console(width=200, record=True)
    console.print(round_table(engine))  # type: ignore[arg-type]
    lines = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line.startswith("│")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in lines if cells[0].strip() in DEVICES}


def test_a_devices_row_starts_with_the_same_cells_in_the_round_and_the_version_view() -> None:
    fleet = SimpleNamespace(fleet="f", rounds=5, quorum=1.0)
    open_ = SimpleNamespace(participants={"pi": Participant(level=0.25, status="accepted", payload_bytes=2048)})
    rounds = SimpleNamespace(runs_async=False, fleet=fleet, next_round=2, last=None, open=open_, devices=DEVICES)
    ticket = Ticket(number=7, device="pi", version=1, level=0.25)
    server = SimpleNamespace(version=3, buffered=1, settings=SimpleNamespace(buffer=2), in_flight={"pi": 1})
    versions = SimpleNamespace(
        runs_async=True, fleet=fleet, server=server, last=None, devices=DEVICES, holding={"pi": ticket}.get
    )

    by_round, by_version = rows(rounds), rows(versions)

    assert by_round["pi"][:5] == by_version["pi"][:5] == ["pi", "raspberry-pi-5", "yes", "training", "1/4"]
    assert by_round["orin"][:5] == by_version["orin"][:5] == ["orin", "jetson-orin-nano-8gb", "yes", "idle", "-"]
    assert by_round["old"][:5] == by_version["old"][:5] == ["old", "raspberry-pi-4", "refused", "unknown", "-"]
    assert by_round["pi"][5:] == ["accepted", "2 KiB", ""] and by_version["pi"][5:] == ["1 (ticket 7)", "2"]
