import json

import pytest

from benchmarks.transport import main
from coordinator.broker.mosquitto import find_mosquitto


@pytest.mark.slow
@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_benchmark_prints_one_json_object_with_ratios_and_throughputs(capsys):
    assert main(["--size-mib", "2", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("mosquitto_ratio", "amqtt_ratio", "mosquitto_vs_single"):
        assert result[key] > 0
    for key in (
        "mosquitto_fedfleet_mbps",
        "mosquitto_fedfleet_in_handler_mbps",
        "mosquitto_raw_chunks_mbps",
        "mosquitto_raw_single_mbps",
        "amqtt_fedfleet_mbps",
        "amqtt_raw_chunks_mbps",
    ):
        assert result[key] > 0
    assert result["chunks"] == 8
