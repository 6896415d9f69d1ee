"""``coordinator report RUN_DIR`` on a synthetic run written through the RunDir API."""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
import torch

from coordinator.cli.app import main
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics
from coordinator.run.report import PLOTS, load_run, plot_rank_assignment, plot_training_time, write_report
from coordinator.run.rundir import RunDir

FLEET = {"pi4": (4, 0.125), "orin": (3, 0.5), "laptop": (2, 1.0)}
PAYLOAD = {0.125: 120_000, 0.5: 410_000, 1.0: 800_000}


def synthetic_run(path: Path, rounds: int = 5, fleet: dict[str, tuple[int, float]] = FLEET) -> RunDir:
    fleet_file = path.parent / "fleet.yaml"
    fleet_file.write_text("fleet: report-test\n")
    rng = random.Random(0)
    rundir = RunDir.create(path, fleet_file, {"w": torch.zeros(3)}, seed=0, run_id="synthetic")
    for round_ in range(1, rounds + 1):
        devices = {}
        for device_class, (count, ratio) in fleet.items():
            for index in range(count):
                status = "late" if (round_, device_class, index) == (3, "pi4", 1) else "accepted"
                status = "rejected" if (round_, device_class, index) == (2, "pi4", 0) else status
                clipped = 0.8 if device_class == "orin" and index == 0 and round_ in (1, 4) else None
                payload = PAYLOAD[ratio]
                devices[f"{device_class}-{index}"] = DeviceRoundMetrics(
                    device_class=device_class,
                    ratio=ratio,
                    bytes_up=int(payload * 1.004) if status == "accepted" else 0,
                    bytes_down=int(payload * 1.01),
                    payload_bytes=payload if status == "accepted" else 0,
                    train_seconds=rng.uniform(2, 9) if status == "accepted" else None,
                    status=status,
                    reason="wrong_direction" if status == "rejected" else None,
                    clipped=clipped,
                )
        rundir.complete_round(
            round_,
            {"w": torch.full((3,), float(round_))},
            RoundMetrics(
                round=round_,
                accuracy=min(0.99, 0.5 + 0.09 * round_),
                loss=1.5 / round_,
                participants=sum(d.status == "accepted" for d in devices.values()),
                bytes_up=sum(d.bytes_up for d in devices.values()),
                bytes_down=sum(d.bytes_down for d in devices.values()),
                seconds=12.0,
                phases={"plan": 0.1, "push": 1.5, "train": 9.0, "aggregate": 0.4, "evaluate": 0.5},
                devices=devices,
            ),
        )
    return rundir


@pytest.mark.slow
def test_report_writes_html_that_shows_the_plots_and_the_summary(tmp_path: Path) -> None:
    synthetic_run(tmp_path / "run").close()
    report = write_report(tmp_path / "run")

    assert report == tmp_path / "run" / "report.html"
    page = report.read_text()
    referenced = re.findall(r'<img src="([^"]+)"', page)
    assert referenced == [f"plots/{name}" for name in PLOTS]
    for name in referenced:
        assert (tmp_path / "run" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<script" not in page and "http" not in page  # self-contained: nothing fetched from elsewhere
    assert "0.9500 (round 5)" in page  # final accuracy 0.5 + 0.09 x 5
    assert "9 in 3 classes" in page
    assert "1/8, 1/2, 1" in page
    assert "pi4-1" in page and "late" in page
    # Per device, refusals and clips as shares of the rounds it was drawn into: an unusual honest device shows.
    assert "<td>1 (20%): wrong_direction 1</td>" in page and "<td>2 (40%)</td>" in page


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_a_1000_device_report_draws_classes_not_devices_and_keeps_each_device_in_the_table(tmp_path: Path) -> None:
    synthetic_run(tmp_path / "run", rounds=3, fleet={"pi4": (500, 0.125), "orin": (300, 0.5), "laptop": (200, 1.0)})
    page = write_report(tmp_path / "run").read_text()

    assert "1000 in 3 classes" in page
    assert "laptop-199" in page and "pi4-499" in page  # the Devices table keeps every device
    for name in ("rank_assignment.png", "training_time.png"):
        width, height = png_size(tmp_path / "run" / "plots" / name)
        assert width < 1000 and height < 1500  # one labelled row per device would be 30,000 px tall
    _, rounds = load_run(tmp_path / "run")
    times = plot_training_time(rounds).axes[0]
    assert [label.get_text() for label in times.get_yticklabels()] == ["laptop (200)", "orin (300)", "pi4 (500)"]
    assert len(plot_rank_assignment(rounds).axes[0].images) == 1  # one image, not a marker per device and round


def test_report_command_regenerates_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic_run(tmp_path / "run", rounds=2).close()
    assert main(["report", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "run" / "report.html")
    assert (tmp_path / "run" / "plots" / "rank_assignment.png").exists()


def test_report_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert f"run directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err

    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 1
    assert "is empty" in capsys.readouterr().err

    synthetic_run(tmp_path / "fresh", rounds=0).close()
    assert main(["report", str(tmp_path / "fresh")]) == 1
    assert "has no completed round yet" in capsys.readouterr().err

    synthetic_run(tmp_path / "run", rounds=3).close()
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    second = json.loads(lines[1])
    second["accuracy"] = "high"
    metrics.write_text("\n".join([lines[0], json.dumps(second), lines[2]]) + "\n")
    assert main(["report", str(tmp_path / "run")]) == 1
    assert re.search(r"metrics\.jsonl line 2: accuracy: Input should be a valid number", capsys.readouterr().err)

    (tmp_path / "run" / "run.json").write_text("{broken")
    assert main(["report", str(tmp_path / "run")]) == 1
    assert re.search(r"run\.json line 1: not valid JSON", capsys.readouterr().err)
