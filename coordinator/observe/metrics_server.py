"""The ``--metrics-port`` endpoint: ``GET /metrics`` in Prometheus' text format, from its own registry."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from coordinator.observe.prometheus import RunCollector
from coordinator.observe.serving import BackgroundServer, ReadOnlyHandler
from coordinator.observe.snapshot import Snapshot


def serve_metrics(host: str, port: int, snapshot: Callable[[], Snapshot | None]) -> BackgroundServer:
    """Start serving; a registry of its own keeps the process' default collectors (and other runs) out."""
    registry = CollectorRegistry()
    registry.register(RunCollector(snapshot))

    class Handler(ReadOnlyHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.reply(404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8")
                return
            self.reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

    return BackgroundServer("metrics", host, port, Handler)
