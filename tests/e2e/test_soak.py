"""The churn soak, short: devices leave and join, the broker and the coordinator are killed, no update is lost."""

import json

import pytest

from benchmarks.soak import MemorySample, clipped, main, memory_summary
from coordinator.run.metrics import DeviceRoundMetrics, RoundMetrics
from coordinator.transport.broker.mosquitto import find_mosquitto

KEYS = {
    "minutes",
    "seed",
    "rounds_closed",
    "updates_accepted",
    "updates_lost",
    "updates_clipped",
    "churn_events",
    "broker_restarts",
    "coordinator_kills",
    "coordinator_memory_mib",
    "memory_growth_after_warmup",
    "failed_rounds",
    "command",
    "coordinator_command",
}


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_a_one_minute_soak_loses_no_update(capsys):
    code = main(["--minutes", "1", "--seed", "3", "--json"])

    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result.keys() >= KEYS, KEYS - result.keys()
    assert result["updates_lost"] == 0, result
    assert result["broker_restarts"] == 1 and result["coordinator_kills"] == 1, result
    assert result["churn_events"]["leaves"] >= 1, result
    assert result["rounds_closed"] >= 2 and result["updates_accepted"] >= 1, result
    assert result["problems"] == [], result
    assert result["command"] == "python -m benchmarks.soak --minutes 1 --seed 3 --json"


def test_memory_growth_leaves_out_each_process_warm_up():
    samples = [MemorySample(0, age, mib) for age, mib in [(1, 50), (2, 300), (10, 400), (20, 410)]]
    samples += [MemorySample(1, age, mib) for age, mib in [(1, 80), (10, 420), (20, 440)]]

    summary, growth = memory_summary(samples, warmup_s=5)

    assert summary["start"] == 405 and summary["end"] == 430 and summary["max"] == 440
    assert growth == round(430 / 405 - 1, 4)
    assert [p["samples"] for p in summary["processes"]] == [2, 2]


def test_the_clipped_updates_are_counted_by_device_with_the_least_share_kept():
    def row(round_: int, shares: dict[str, float | None]) -> RoundMetrics:
        devices = {
            device: DeviceRoundMetrics(
                device_class="raspberry-pi-5",
                ratio=0.5,
                bytes_up=1,
                bytes_down=1,
                payload_bytes=1,
                status="accepted",
                clipped=share,
            )
            for device, share in shares.items()
        }
        return RoundMetrics(
            round=round_, participants=len(devices), bytes_up=1, bytes_down=1, seconds=1.0, devices=devices
        )

    rows = [row(1, {"pi5-01": None, "pi5-02": 0.5}), row(2, {"pi5-01": 0.25, "pi5-02": 0.75})]
    assert clipped(rows) == {"updates": 3, "by_device": {"pi5-01": 1, "pi5-02": 2}, "least_share_kept": 0.25}
    assert clipped([row(3, {"pi5-01": None})]) == {"updates": 0, "by_device": {}, "least_share_kept": None}
