"""Fixtures of the e2e tests: the exported-model runs of tests/export, and a venv without torch."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

from tests.export.conftest import cnn_export, cnn_run
from tests.paths import REPO_ROOT

__all__ = ["cnn_export", "cnn_run", "run_torchless", "torchless_python"]


@pytest.fixture(scope="session")
def torchless_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install onnxruntime numpy` (the [infer] extra) and nothing else."""
    home = tmp_path_factory.mktemp("infer-venv")
    venv.create(home, with_pip=True)
    python = home / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "onnxruntime", "numpy"], check=True, timeout=600)
    return python


def run_torchless(python: Path, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` with the agent's source on the path, as a device checkout has it."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([python, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO_ROOT)
