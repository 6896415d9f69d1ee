"""Which packages the agent's commands need: checked before a command runs, named in one line when missing."""

from __future__ import annotations

import re

import pytest

from device_agent.cli.app import main
from device_agent.cli.needs import AGENT_PACKAGES, install_hint, installed, missing_packages
from tests.paths import REPO_ROOT


def test_the_checked_packages_are_the_agents_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(AGENT_PACKAGES.values()) == sorted(re.split(r"[<>=!~\[ ]", spec)[0] for spec in dependencies)


def test_a_full_install_lacks_nothing() -> None:
    assert missing_packages() == []
    assert installed("torch") and not installed("no_such_package.sub")


def test_the_hint_is_one_line_naming_the_package_and_the_cpu_index() -> None:
    hint = install_hint("run", ["torch", "pydantic"])
    assert "\n" not in hint
    assert hint.startswith("run needs torch, pydantic, which this install lacks")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in hint


def test_a_missing_package_stops_the_command_before_it_imports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("device_agent.cli.needs.installed", lambda module: module != "psutil")
    assert main(["doctor", "--config", "nowhere.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("device-agent: error: doctor needs psutil, which this install lacks")
