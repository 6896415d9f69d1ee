import json

import pytest

from benchmarks import suite
from benchmarks.suite import SUITE, Benchmark, main, run_suite
from benchmarks.table import BEGIN, END


@pytest.fixture
def fake_runs(monkeypatch):
    """Each benchmark 'prints' {"benchmark": name, "score": <how many runs so far>} without running."""
    runs: list[str] = []

    def run_one(benchmark: Benchmark, cuda: bool, timeout_s: float) -> dict:
        runs.append(benchmark.name)
        command = " ".join(benchmark.command(cuda))
        return {"command": command, "result": {"benchmark": benchmark.name, "score": len(runs)}, "seconds": 0.1}

    monkeypatch.setattr(suite, "run_one", run_one)
    monkeypatch.setattr(suite, "describe", lambda: CPU_HOST)
    return runs


CPU_HOST = {"cpu": "test", "cores": 2, "ram_gib": 8.0, "torch": "2.13.0+cpu", "gpu": None}


def test_the_suite_records_each_benchmark_with_its_command_machine_and_date(tmp_path, fake_runs):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\nstale\n{END}\n")
    results_path = tmp_path / "results.json"

    run_suite([b.name for b in SUITE], results_path, readme, timeout_s=10)

    results = json.loads(results_path.read_text())
    assert list(results["benchmarks"]) == [b.name for b in SUITE if not b.gpu_only] == fake_runs
    transport = results["benchmarks"]["transport"]
    assert transport["command"].startswith("python -m benchmarks.transport --json --size-mib")
    assert {"cpu", "cores", "ram_gib", "torch", "gpu"} <= set(transport["machine"])
    assert transport["device"] in ("cpu", "cuda") and transport["date"].endswith("UTC")
    text = readme.read_text()
    assert "stale" not in text
    assert "| transport | `python -m benchmarks.transport --json --size-mib" in text


def test_only_reruns_some_and_keeps_the_others(tmp_path, fake_runs):
    results_path = tmp_path / "results.json"
    run_suite(["refactorize", "export"], results_path, None, timeout_s=10)
    run_suite(["export"], results_path, None, timeout_s=10)
    entries = json.loads(results_path.read_text())["benchmarks"]
    assert entries["refactorize"]["result"]["score"] == 1
    assert entries["export"]["result"]["score"] == 3


def test_a_gpu_only_benchmark_keeps_its_figures_on_a_host_without_a_gpu_and_runs_with_cuda_on_one(
    tmp_path, fake_runs, monkeypatch
):
    results_path = tmp_path / "results.json"
    gpu_only = next(b.name for b in SUITE if b.gpu_only)
    monkeypatch.setattr(suite, "describe", lambda: CPU_HOST | {"gpu": "NVIDIA H200"})
    run_suite([gpu_only], results_path, None, timeout_s=10)
    monkeypatch.setattr(suite, "describe", lambda: CPU_HOST)
    run_suite([gpu_only], results_path, None, timeout_s=10)
    entry = json.loads(results_path.read_text())["benchmarks"][gpu_only]
    assert fake_runs == [gpu_only] and entry["device"] == "cuda" and entry["machine"]["gpu"] == "NVIDIA H200"
    assert entry["command"].endswith("--device-type cuda")


def test_unknown_benchmarks_and_broken_results_files_get_one_clear_line(tmp_path, fake_runs, capsys):
    with pytest.raises(SystemExit):
        main(["--only", "transport,nosuch"])
    assert "unknown benchmark(s) nosuch" in capsys.readouterr().err
    broken = tmp_path / "results.json"
    broken.write_text("{not json")
    assert main(["--results", str(broken), "--no-readme"]) == 1
    assert "is not valid JSON" in capsys.readouterr().err
    assert fake_runs == []


def test_a_benchmark_that_fails_is_reported_with_its_exit_status_and_stderr():
    with pytest.raises(suite.BenchmarkFailed, match=r"nosuch exited with 1:\n.*No module named benchmarks.nosuch"):
        suite.run_one(Benchmark("nosuch"), cuda=False, timeout_s=60)


@pytest.mark.parametrize(
    "stdout",
    ['{\n  "benchmark": "costmodel",\n  "score": 1\n}\n', 'warming up...\n{"benchmark": "costmodel", "score": 1}\n'],
)
def test_indented_json_and_json_after_progress_lines_are_both_read(stdout):
    assert suite.parse_output("costmodel", stdout) == {"benchmark": "costmodel", "score": 1}


def test_output_without_a_json_object_is_refused():
    with pytest.raises(suite.BenchmarkFailed, match="costmodel printed no JSON object"):
        suite.parse_output("costmodel", "done\n[1, 2]\n")


def test_a_run_made_outside_the_suite_is_recorded_with_the_provenance_it_carries(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\nstale\n{END}\n")
    results_path = tmp_path / "results.json"
    output = tmp_path / "out.json"
    provenance = CPU_HOST | {"commit": "0123456789abcdef", "dirty": False}
    output.write_text(json.dumps({"hetero-devices/dirichlet-0.5": {}, "checks": [], "provenance": provenance}))
    command = "python -m benchmarks.compare --json --seeds 5"

    assert (
        main(
            [
                "--record",
                "compare_partial",
                str(output),
                command,
                "--results",
                str(results_path),
                "--readme",
                str(readme),
                "--note",
                "partial: one scenario",
            ]
        )
        == 0
    )

    entry = json.loads(results_path.read_text())["benchmarks"]["compare_partial"]
    assert entry["machine"] == provenance and entry["command"] == command and entry["note"] == "partial: one scenario"
    assert "provenance" not in entry["result"] and entry["device"] == "cpu" and entry["date"].endswith("UTC")
    assert "| compare_partial | `python -m benchmarks.compare --json --seeds 5`" in readme.read_text()
    assert "commit 0123456" in readme.read_text()


def test_a_run_without_provenance_is_not_recorded(tmp_path, capsys):
    output = tmp_path / "out.json"
    output.write_text(json.dumps({"accuracy": 0.9}))
    results_path = tmp_path / "results.json"
    assert main(["--record", "x", str(output), "cmd", "--results", str(results_path), "--no-readme"]) == 1
    assert "carries no provenance" in capsys.readouterr().err and not results_path.exists()
