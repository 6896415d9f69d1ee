"""The device agent's command line, written as examples of how to use it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from device_agent import __version__
from device_agent.agent.probe import probe_device
from device_agent.cli.app import main
from device_agent.common.profile import DeviceProfile


def test_probe_device_measures_plausible_numbers() -> None:
    profile = probe_device(benchmark_seconds=0.1, device="cpu")

    assert profile.protocol_version == 1
    assert profile.accelerator == "cpu"
    assert profile.accelerator_name is None
    assert profile.accelerator_memory_bytes is None
    assert profile.cpu_count >= 1
    assert profile.memory_total_bytes >= profile.memory_available_bytes > 0
    assert profile.matmul_gflops > 0
    assert profile.hostname
    assert profile.torch == torch.__version__


def test_probing_leaves_the_training_rng_alone() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(3)

    torch.manual_seed(1234)
    probe_device(benchmark_seconds=0.05, device="cpu")
    assert torch.equal(torch.rand(3), expected)


def test_probe_prints_json_that_parses_back_into_a_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu", "--seconds", "0.1"]) == 0

    profile = DeviceProfile.model_validate_json(capsys.readouterr().out)
    assert profile.accelerator == "cpu"
    assert profile.matmul_gflops > 0


def test_probe_human_prints_a_short_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu", "--seconds", "0.1", "--human"]) == 0

    out = capsys.readouterr().out
    assert "GiB total" in out
    assert "GFLOPS" in out
    assert not out.lstrip().startswith("{")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so asking for it is valid")
def test_asking_for_missing_cuda_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="cuda"):
        probe_device(benchmark_seconds=0.1, device="cuda")

    assert main(["probe", "--device", "cuda", "--seconds", "0.1"]) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "CUDA is not available" in captured.err


def test_unknown_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="tpu"):
        probe_device(device="tpu")


def test_benchmark_budget_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--seconds", "0"]) == 2

    assert "positive" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0

    assert capsys.readouterr().out.strip() == f"device-agent {__version__}"


def test_no_command_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2

    assert "probe" in capsys.readouterr().err


def test_help_names_probe_and_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0

    out = " ".join(capsys.readouterr().out.split())
    assert "device-agent probe" in out
    assert "device-agent run --config agent.yaml" in out


def _console_script() -> str | None:
    found = shutil.which("device-agent")
    if found:
        return found
    beside_python = Path(sys.executable).parent / "device-agent"
    return str(beside_python) if beside_python.exists() else None


@pytest.mark.slow
def test_installed_console_script_probes_the_cpu() -> None:
    script = _console_script()
    if script is None:
        pytest.skip("device-agent console script is not installed")

    result = subprocess.run(
        [script, "probe", "--device", "cpu", "--seconds", "0.1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accelerator"] == "cpu"


@pytest.mark.slow
def test_device_agent_never_imports_coordinator_export_or_benchmarks() -> None:
    code = (
        "import device_agent.cli.app, device_agent.agent.probe, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'coordinator','export','benchmarks'}))"
    )

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
