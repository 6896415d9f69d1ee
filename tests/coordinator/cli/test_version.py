"""One version: device_agent.__version__, which pyproject.toml reads and both commands report."""

from pathlib import Path

import pytest

import coordinator
import device_agent
from coordinator.cli.app import build_parser
from device_agent.cli.app import main as device_agent_main

ROOT = Path(__file__).resolve().parents[3]


def test_pyproject_takes_its_version_from_the_agent_package() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())

    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "device_agent.__version__"}
    assert coordinator.__version__ == device_agent.__version__


def test_both_commands_print_the_one_version(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"coordinator {device_agent.__version__}"

    assert device_agent_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"device-agent {device_agent.__version__}"
