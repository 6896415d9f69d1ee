import json

import pytest

from benchmarks.transport import main
from coordinator.transport.broker.mosquitto import find_mosquitto


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_benchmark_prints_one_json_object_with_ratios_and_throughputs(capsys):
    fan_in = ["--devices", "2", "--fan-in-mib", "1", "--fan-in-repeats", "1"]
    assert main(["--size-mib", "2", "--repeats", "1", *fan_in, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ratios = ("fan_in_ratio", "fan_in_hashing_ratio", "fan_in_hash_bound_ratio", "fan_in_vs_hash_bound")
    for key in ("mosquitto_ratio", "amqtt_ratio", "mosquitto_vs_single", *ratios):
        assert result[key] > 0
    for key in (
        "mosquitto_fedfleet_mbps",
        "mosquitto_fedfleet_in_handler_mbps",
        "mosquitto_raw_chunks_mbps",
        "mosquitto_raw_single_mbps",
        "amqtt_fedfleet_mbps",
        "amqtt_raw_chunks_mbps",
        "fan_in_raw_mbps",
        "fan_in_raw_hashing_mbps",
        "fan_in_fedfleet_mbps",
        "fan_in_fedfleet_hashing_mbps",
    ):
        assert result[key] > 0
    assert result["chunks"] == 8
    for side in ("receiver", "devices", "broker"):
        assert result[f"fan_in_fedfleet_{side}_cpu_ms"] >= 0
    # 2 MiB in all may pass within one 10 ms clock tick of CPU time: then there is no ratio to report.
    for key in ("fan_in_cpu_vs_hash_bound", "fan_in_receiver_cpu_vs_hash_bound"):
        assert result[key] is None or result[key] > 0


def test_bad_fan_in_options_are_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit):
        main(["--fan-in-repeats", "0"])
    assert "--fan-in-repeats >= 1" in capsys.readouterr().err
