"""The fedfleet coordinator: fleet config, planning, strategies, rounds, transport and brokers, run storage, CLI."""

from device_agent import __version__

__all__ = ["__version__"]
