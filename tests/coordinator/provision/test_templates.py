"""The kit's file templates: ``@name`` placeholders filled, a missing one named, all shipped as package data."""

from __future__ import annotations

import fnmatch
from importlib import resources
from pathlib import Path

import pytest

from coordinator.config.fleet import load_fleet
from coordinator.provision.broker_files import config_text
from coordinator.provision.templates import FOLDER, PACKAGE, render
from coordinator.transport.broker.base import MAX_CONNECTIONS
from tests.paths import REPO_ROOT


def test_a_template_renders_with_its_values() -> None:
    assert render("mosquitto-plain.conf", port=1883, host="0.0.0.0", max_connections=1000) == (
        "# plain TCP, asked for in fleet.yaml (transport.broker.plain_port): passwords cross the network in clear\n"
        "listener 1883 0.0.0.0\n"
        "max_connections 1000\n"
    )


def test_a_missing_value_names_the_template_and_the_placeholder() -> None:
    with pytest.raises(ValueError, match=r"templates/user-data needs a value for @device"):
        render("user-data")


def test_every_template_ships_in_the_wheel() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    globs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    templates = [t.name for t in (resources.files(PACKAGE) / FOLDER).iterdir() if t.is_file()]
    assert {"install.sh", "fedfleet-agent.service", "user-data", "README.md", "mosquitto.conf"} <= set(templates)
    package_relative = PACKAGE.split(".", 1)[1].replace(".", "/")
    for name in templates:
        path = f"{package_relative}/{FOLDER}/{name}"
        assert any(fnmatch.fnmatch(path, g) for g in globs["coordinator"]), f"{path} is not in package-data"


def test_every_listener_of_a_provisioned_broker_has_its_connection_limit(tmp_path: Path) -> None:
    """mosquitto applies ``max_connections`` to the listener it follows: the TLS one and the plain one both."""
    (tmp_path / "fleet.yaml").write_text(
        "fleet: lab\nbroker: {mode: managed, host: 127.0.0.1, port: 18883, plain_port: 11883}\n"
        "devices:\n  - {id: pi, profile: raspberry-pi-5}\n"
    )
    lines = config_text(load_fleet(tmp_path / "fleet.yaml")[0], tmp_path).splitlines()
    listeners = [i for i, line in enumerate(lines) if line.startswith("listener ")]
    assert [lines[i] for i in listeners] == ["listener 18883 127.0.0.1", "listener 11883 127.0.0.1"]
    assert all(lines[i + 1] == f"max_connections {MAX_CONNECTIONS}" for i in listeners)
