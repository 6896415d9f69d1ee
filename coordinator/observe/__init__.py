"""Watching a run: Prometheus metrics and a read-only status page, both read from engine snapshots."""

from coordinator.observe.serving import ObserveError
from coordinator.observe.watch import Watch, add_observe_arguments

__all__ = ["ObserveError", "Watch", "add_observe_arguments"]
