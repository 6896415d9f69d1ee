"""A registry is filled once, by importing its package, and never seen half-filled by another thread."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from device_agent.common.registry import Registry

SLOW_MODULE = """
import time
from {package} import REGISTRY
time.sleep(0.3)  # a heavy import (torch models): the other threads ask in the meantime
REGISTRY.register("{name}", object())
"""


@pytest.fixture
def slow_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    package = tmp_path / "slowplugins"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from device_agent.common.registry import Registry\n"
        "REGISTRY = Registry('program', 'slowplugins', 'fedfleet.test-none')\n"
    )
    for name in ("alpha", "beta"):
        (package / f"{name}.py").write_text(SLOW_MODULE.format(package="slowplugins", name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "slowplugins"
    for module in [m for m in sys.modules if m.split(".")[0] == "slowplugins"]:
        del sys.modules[module]


def test_threads_asking_while_the_first_lookup_imports_see_every_registration(slow_package: str) -> None:
    registry: Registry[object] = __import__(slow_package).REGISTRY
    seen: list[list[str]] = []
    threads = [threading.Thread(target=lambda: seen.append(sorted(registry))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [["alpha", "beta"]] * 8
