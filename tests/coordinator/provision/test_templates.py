"""The kit's file templates: ``@name`` placeholders filled, a missing one named, all shipped as package data."""

from __future__ import annotations

import fnmatch
from importlib import resources

import pytest

from coordinator.provision.templates import FOLDER, PACKAGE, render
from tests.paths import REPO_ROOT


def test_a_template_renders_with_its_values() -> None:
    assert render("mosquitto-plain.conf", port=1883, host="0.0.0.0", max_connections=1000) == (
        "# plain TCP, asked for in fleet.yaml (broker.plain_port): passwords cross the network in clear\n"
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
