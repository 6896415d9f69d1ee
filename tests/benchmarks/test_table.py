import pytest

from benchmarks.table import BEGIN, END, TableError, render, replace_table

MACHINE = {"cpu": "Test CPU", "cores": 2, "ram_gib": 15.6, "torch": "2.13.0", "gpu": None, "commit": "8b6ad29e0f"}
MACHINE |= {"dirty": False}


def results(**benchmarks: dict) -> dict:
    return {
        "benchmarks": {
            name: {
                "command": f"python -m benchmarks.{name} --json",
                "result": result,
                "machine": MACHINE,
                "device": "cpu",
                "date": "2026-11-23 15:00 UTC",
            }
            for name, result in benchmarks.items()
        }
    }


def test_a_known_benchmark_shows_its_headlines_with_command_and_machine():
    table = render(results(transport={"benchmark": "transport", "fan_in_ratio": 0.8567, "chunks": 64}))
    row = next(line for line in table.splitlines() if line.startswith("| transport"))
    assert "`fan_in_ratio` 0.857" in row
    assert "chunks" not in row  # not a headline of transport
    assert "`python -m benchmarks.transport --json`" in row
    assert "Test CPU, 2 cores, 15.6 GiB RAM, torch 2.13.0, no GPU, commit 8b6ad29; cpu; 2026-11-23 15:00 UTC" in row
    assert table.startswith(BEGIN) and table.endswith(END)


def test_the_machine_column_says_the_commit_and_a_dirty_tree_or_that_none_was_recorded():
    entries = results(transport={"fan_in_ratio": 0.8})
    entries["benchmarks"]["transport"]["machine"] = MACHINE | {"dirty": True}
    assert "no GPU, commit 8b6ad29 (dirty); cpu" in render(entries)
    entries["benchmarks"]["transport"]["machine"] = MACHINE | {"commit": None, "dirty": None}
    assert "no GPU, commit not recorded; cpu" in render(entries)


def test_an_unknown_benchmark_shows_every_top_level_scalar():
    result = {"benchmark": "future_benchmark", "recovered": 12, "loss_rate": 0.123456, "ok": True, "rows": [1, 2]}
    row = render(results(future_benchmark=result)).splitlines()[-2]
    assert row.startswith("| future_benchmark |")
    assert "`recovered` 12; `loss_rate` 0.123; `ok` True |" in row
    assert "rows" not in row and "`benchmark`" not in row


def test_nested_benchmarks_are_summarized():
    compare = {"hetero": {"fedhm": {"accuracy": {"mean": 0.91, "std": 0.0}}, "fedavg": {"accuracy": {"mean": 0.9}}}}
    emulation = {
        "slowdown": [{"factor": 2, "measured_vs_own_compute": 2.01}, {"factor": 4, "measured_vs_own_compute": 4.0}],
        "device_time": [{"device_class": "pi4", "emulated_vs_predicted": 1.17}],
    }
    table = render(results(compare=compare, emulation=emulation))
    assert "hetero accuracy: fedhm 0.91, fedavg 0.9" in table
    assert "slowdown x2/x4 measured 2.01/4" in table
    assert "device time pi4: emulated/predicted 1.17" in table


def test_each_strategy_is_shown_on_its_papers_metric_with_the_claims_tally():
    row = {"accuracy": {"mean": 0.1, "std": 0.0}, "personalized_accuracy": {"mean": 0.8, "std": 0.0}}
    compare = {
        "permuted": {"fedavg": row, "simfed": row},
        "paper_metric": {"fedavg": "accuracy", "simfed": "personalized_accuracy"},
        "checks": [{"verdict": "PASS"}, {"verdict": "FAIL"}, {"verdict": "PASS"}, {"verdict": "TIE"}],
    }
    table = render(results(compare=compare))
    assert "permuted accuracy: fedavg 0.1, simfed 0.8 (p)" in table
    assert "papers' claims: 2 PASS, 1 TIE, 1 FAIL" in table


def test_each_claim_judged_on_an_interval_is_shown_with_it():
    claim = {"setting": "large/d0.5", "claim": "FedHM >= HeteroFL", "verdict": "PASS", "difference": 0.034}
    compare = {"checks": [claim | {"interval": [0.001, 0.067]}, {"verdict": "FAIL"}]}
    table = render(results(compare_5_seeds=compare))
    assert "papers' claims: 1 PASS, 1 FAIL; FedHM >= HeteroFL (large/d0.5): PASS +0.034 [+0.001, +0.067]" in table


def test_the_fedlora_row_shows_the_bases_probe_each_entry_and_the_papers_checks():
    entry = {"accuracy": {"mean": 0.8771, "std": 0.01}, "upload_bytes_per_round": 2048.0}
    claim = "fedlora_at_least_homogeneous_lora_at_smallest_r"
    fedlora = {
        "probe_accuracy": 0.893,
        "pixel_probe_accuracy": 0.939,
        "fedlora/dirichlet-0.1": {"ft": entry, "lora_r2": entry},
        "checks": {
            "base_transfers": True,
            claim: {"verdict": "TIE", "detail": "fedlora - lora_r2 = +0.004"},
        },
    }
    row = next(line for line in render(results(fedlora=fedlora)).splitlines() if line.startswith("| fedlora"))
    assert "`probe_accuracy` 0.893 (pixels 0.939)" in row
    assert "fedlora/dirichlet-0.1 accuracy: ft 0.877 (2 KiB up), lora_r2 0.877 (2 KiB up)" in row
    assert f"base_transfers: PASS; {claim}: TIE (fedlora - lora_r2 = +0.004)" in row
    fedlora["checks"][claim] = False  # recorded before the intervals
    row = next(line for line in render(results(fedlora=fedlora)).splitlines() if line.startswith("| fedlora"))
    assert f"{claim}: FAIL" in row


def test_the_table_replaces_only_what_lies_between_the_markers():
    readme = f"intro\n{BEGIN}\nold figures\n{END}\noutro\n"
    assert replace_table(readme, f"{BEGIN}\nnew\n{END}") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: render({"benchmarks": {}}), "no 'benchmarks'"),
        (lambda: render({"benchmarks": {"x": {"result": {}}}}), "'x' lacks its command"),
        (lambda: replace_table("no markers here", "table"), "no <!-- bench:begin -->"),
    ],
)
def test_bad_input_is_refused_with_the_reason(call, message):
    with pytest.raises(TableError, match=message):
        call()


def test_the_reliability_and_scale_benchmarks_have_their_own_summaries() -> None:
    results = {
        "benchmarks": {
            "faults": {
                "command": "python -m benchmarks.faults --json",
                "result": {
                    "scenarios": {
                        "kill -9 one agent": {"survived": True, "lost_updates": 0},
                        "kill -9 the broker": {"survived": False, "lost_updates": 2},
                    },
                    "bad_inputs": {
                        "nan": {"refused": True, "round_unaffected": True},
                        "flood": {"refused": False, "round_unaffected": True},
                    },
                },
                "machine": {"cpu": "x", "cores": 2},
            },
            "emulation_scale": {
                "command": "python -m benchmarks.emulation --json --scale",
                "result": {
                    "max_devices": 300,
                    "ratio_vs_flower_300": 0.82,
                    "runs": [
                        {
                            "devices": 300,
                            "completed": True,
                            "round_seconds": [49.8, 32.1],
                            "accepted_per_round": [300, 299],
                            "accuracy": [0.5448, 0.6309],
                            "dataset": "fashion_mnist",
                            "deadline_seconds": 60.0,
                            "slowest_predicted_round_seconds": 0.04,
                            "coordinator_rss_per_device_mib": 2.2,
                            "workers_rss_per_device_mib": 9.4,
                            "tree_peak_pss_mib": 1827.9,
                            "flower": {
                                "flwr": "1.42.0",
                                "round_seconds": [23.6, 10.8],
                                "updates_per_round": [300, 300],
                                "accuracy": [0.1226, 0.2312],
                                "tree_peak_pss_mib": 1734.0,
                            },
                        }
                    ],
                },
                "machine": {"cpu": "x", "cores": 2},
            },
        }
    }

    text = render(results)

    assert "1/2 faults survived, 2 updates lost; bad inputs refused 1/2, round unaffected 2/2" in text
    assert "`max_devices` 300; 300 devices completed: rounds 49.8/32.1 s (deadline 60 s" in text
    assert "updates 300/299, accuracy 0.545/0.631 on fashion_mnist, coordinator 2.2 MiB/device" in text
    assert "workers 9.4 MiB/device, process tree peak 1828 MiB PSS" in text
    assert "Flower 1.42.0 on the same task, 300 clients: rounds 23.6/10.8 s, updates 300/300" in text
    assert "accuracy 0.123/0.231, process tree peak 1734 MiB PSS" in text
    assert "`ratio_vs_flower_300` 0.82 (fedfleet / Flower median round)" in text
