"""Run directories shared by the export tests (each trains one small in-process round)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.run.exporting import open_trained_run
from export.runner import ExportOptions, ExportRecord, export_run
from export.targets import TrainedRun
from tests.export.runs import make_run


@pytest.fixture(scope="session")
def cnn_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("cnn"), "cnn", "fedhm")


@pytest.fixture(scope="session")
def resnet18_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ResNet-18 on digits resized to 3 x 32 x 32, few samples: a real model, seconds to train."""
    return make_run(tmp_path_factory.mktemp("resnet18"), "resnet18", "fedhm", image_size=32, in_channels=3, samples=16)


@pytest.fixture(scope="session")
def ffl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("ffl"), "cnn", "factorized_fl", ratios=("1",))


@pytest.fixture
def cnn(cnn_run: Path) -> TrainedRun:
    return open_trained_run(cnn_run)


@pytest.fixture(scope="session")
def cnn_export(cnn_run: Path, tmp_path_factory: pytest.TempPathFactory) -> ExportRecord:
    """The small CNN at gamma 1/2, exported once with its int8 copy and latency (exports are seconds each)."""
    out = tmp_path_factory.mktemp("cnn-export") / "half.onnx"
    return export_run(open_trained_run(cnn_run), ExportOptions(out=out, ratio=0.5, quantize=True))
