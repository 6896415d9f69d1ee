"""What a ``device-agent`` command needs beyond the standard library, checked before it runs.

An inference-only device installs onnxruntime, numpy and the agent with ``--no-deps`` (docs/export.md):
there ``infer`` works and every other command would die in an import deep inside. Checking the
packages up front turns that into one line naming what is missing and how to install it.
"""

from __future__ import annotations

import importlib.util

from device_agent import __version__
from device_agent.common.names import TORCH_CPU_INDEX

# import name -> pip name: the agent's dependencies in pyproject.toml (a test keeps the two equal).
AGENT_PACKAGES = {
    "torch": "torch",
    "numpy": "numpy",
    "paho.mqtt": "paho-mqtt",
    "pydantic": "pydantic",
    "safetensors": "safetensors",
    "psutil": "psutil",
    "yaml": "pyyaml",
    "websockets": "websockets",
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (torch takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or half installed
        return False


def missing_packages() -> list[str]:
    """The pip names of the agent's dependencies this environment lacks: every command but ``infer`` needs them."""
    return [package for module, package in AGENT_PACKAGES.items() if not installed(module)]


def install_hint(command: str, missing: list[str]) -> str:
    """One line: what ``device-agent COMMAND`` lacks and the commands that install it."""
    return (
        f"{command} needs {', '.join(missing)}, which this install lacks (only `device-agent infer` runs "
        f"without them): install the agent with its dependencies, i.e. the kit's install.sh, or "
        f"pip install torch --index-url {TORCH_CPU_INDEX} && pip install fedfleet_agent-{__version__}-py3-none-any.whl"
    )
