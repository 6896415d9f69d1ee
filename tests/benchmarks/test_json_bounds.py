import json

from benchmarks.json_bounds import main


def test_benchmark_prints_scan_and_parse_times_for_every_input(capsys):
    assert main(["--size-kib", "16", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for name in ("benign_nack", "nesting_bomb", "empty_pairs", "escaped_quotes", "long_string"):
        assert result[f"{name}_scan_ms"] >= 0 and result[f"{name}_parse_message_ms"] >= 0
        assert result[f"{name}_scan_vs_benign_loads"] >= 0
    assert result["size_bytes"] == 16 << 10 and 0 < result["benign_bytes"] <= 16 << 10
