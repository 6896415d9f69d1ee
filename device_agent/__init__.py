"""The fedfleet device agent: the flashable runtime that trains, on one device, the client program of
whichever strategy the coordinator assigns.

It depends on torch, numpy, paho-mqtt, pydantic, safetensors, psutil and pyyaml only, and never
imports the coordinator. ``__version__`` is fedfleet's one version: pyproject.toml reads it, the agent
wheel and its hello carry it, and ``coordinator --version`` reports it.
"""

__version__ = "0.1.0"
