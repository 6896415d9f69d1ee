"""device-agent infer on a device with onnxruntime and numpy only: no torch installed at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from coordinator.run.exporting import open_trained_run
from device_agent.infer import ModelInfo, preprocess, read_inputs
from export.runner import ExportRecord
from export.targets import build_target, load_run_data
from tests.e2e.conftest import run_torchless as _run
from tests.paths import REPO_ROOT

REPO = REPO_ROOT


def test_same_top1_as_torch_without_torch(
    torchless_python: Path, cnn_run: Path, cnn_export: ExportRecord, tmp_path: Path
) -> None:
    probe = _run(torchless_python, "-c", "import torch")
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    run = open_trained_run(cnn_run)
    x = load_run_data(run).test_x[:12]
    np.save(tmp_path / "batch.npy", x[:, 0].numpy())  # (N, 8, 8) floats in [0, 1]
    pixels = (x[0, 0].numpy() * 255).round().astype(np.uint8)
    (tmp_path / "digit.pgm").write_bytes(b"P5\n# a digit\n8 8\n255\n" + pixels.tobytes())
    result = _run(
        torchless_python,
        "-m",
        "device_agent",
        "infer",
        "--model",
        cnn_export.file,
        str(tmp_path / "batch.npy"),
        str(tmp_path / "digit.pgm"),
        "--json",
        "--top",
        "3",
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    target = build_target(run, ratio=0.5)
    with torch.no_grad():
        expected = target.reference(x).argmax(1).tolist()
        expected.append(int(target.reference(torch.from_numpy(pixels / 255.0).float()[None, None]).argmax()))
    assert [row["top"][0]["index"] for row in rows] == expected
    assert all(len(row["top"]) == 3 and row["top"][0]["class"] == str(row["top"][0]["index"]) for row in rows)
    assert rows[-1]["input"].endswith("digit.pgm")
    # The module entry point works the same way, with readable text output.
    text = _run(torchless_python, "-m", "device_agent.infer", "--model", cnn_export.file, str(tmp_path / "digit.pgm"))
    assert text.returncode == 0 and text.stdout.startswith(str(tmp_path / "digit.pgm")), text.stderr


def test_infer_errors_name_the_problem(torchless_python: Path, cnn_export: ExportRecord, tmp_path: Path) -> None:
    missing = _run(torchless_python, "-m", "device_agent", "infer", "--model", cnn_export.file, "nope.npy")
    assert missing.returncode == 1 and "nope.npy: no such file" in missing.stderr
    png = tmp_path / "a.png"
    png.write_bytes(b"\x89PNG")
    no_pillow = _run(torchless_python, "-m", "device_agent", "infer", "--model", cnn_export.file, str(png))
    assert no_pillow.returncode == 1 and "needs Pillow" in no_pillow.stderr


def test_the_command_line_without_torch(torchless_python: Path) -> None:
    """--help, --version and a bare call work; a command that trains names what it needs in one line."""
    helped = _run(torchless_python, "-m", "device_agent", "--help")
    assert helped.returncode == 0, helped.stderr
    assert all(command in helped.stdout for command in ("run", "doctor", "probe", "infer"))
    version = _run(torchless_python, "-m", "device_agent", "--version")
    assert version.returncode == 0 and version.stdout.strip().startswith("device-agent "), version.stderr
    bare = _run(torchless_python, "-m", "device_agent")
    assert bare.returncode == 2 and "usage: device-agent" in bare.stderr and "Traceback" not in bare.stderr
    assert _run(torchless_python, "-m", "device_agent", "run", "--help").returncode == 0
    for command in (["run", "--kit", "kit"], ["probe"], ["doctor", "--config", "agent.yaml"]):
        result = _run(torchless_python, "-m", "device_agent", *command)
        assert result.returncode == 1 and result.stdout == "", result.stderr
        line, *rest = result.stderr.splitlines()
        assert rest == [] and line.startswith(f"device-agent: error: {command[0]} needs torch")
        assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in line


def test_preprocessing_matches_the_training_data_pipeline() -> None:
    """Resize and channel conversion as device_agent.data.datasets.fit_to_model does them with torch."""
    image = np.random.default_rng(0).random((8, 8), dtype=np.float32)
    info = ModelInfo((3, 32, 32), [str(i) for i in range(10)], 1 / 255, [0.0] * 3, [1.0] * 3, {})
    expected = F.interpolate(torch.from_numpy(image)[None, None].expand(1, 3, 8, 8), size=(32, 32), mode="bilinear")
    assert np.abs(preprocess(image, info) - expected[0].numpy()).max() < 1e-6
    rgb = np.random.default_rng(1).integers(0, 256, (12, 12, 3), dtype=np.uint8)
    gray = ModelInfo((1, 6, 6), ["a"], 1 / 255, [0.5], [0.25], {})
    x = torch.from_numpy(rgb.transpose(2, 0, 1).astype(np.float32) / 255)[None]
    x = (x * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    x = (F.interpolate(x, size=(6, 6), mode="bilinear") - 0.5) / 0.25
    assert np.abs(preprocess(rgb, gray) - x[0].numpy()).max() < 1e-5


def test_batches_in_npz_and_4d_arrays(tmp_path: Path) -> None:
    np.savez(tmp_path / "b.npz", x=np.zeros((3, 1, 8, 8), np.float32))
    assert [name for name, _ in read_inputs(tmp_path / "b.npz")] == [f"{tmp_path / 'b.npz'}[{i}]" for i in range(3)]
    np.save(tmp_path / "one.npy", np.zeros((8, 8, 3), np.uint8))
    assert len(read_inputs(tmp_path / "one.npy")) == 1


def test_infer_module_never_imports_torch() -> None:
    code = "import sys, device_agent.cli.app, device_agent.infer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"
