"""The ``--metrics-port`` / ``--status-port`` options of ``coordinator start`` and ``emulate``: off by default."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.observe.serving import BackgroundServer, ObserveError
from coordinator.observe.snapshot import FleetWatch
from coordinator.run.metrics import RoundMetrics

if TYPE_CHECKING:
    from coordinator.rounds.engine import RoundEngine

LOCALHOST = "127.0.0.1"


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range (0-65535; 0 picks a free port)")
    return port


def add_observe_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "watching a run", "both servers are off unless a port is given, and listen on localhost unless told otherwise"
    )
    group.add_argument(
        "--metrics-port", type=_port, metavar="PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics"
    )
    group.add_argument(
        "--metrics-host", default=LOCALHOST, metavar="HOST", help=f"address the metrics bind to (default: {LOCALHOST})"
    )
    group.add_argument(
        "--status-port", type=_port, metavar="PORT", help="serve a live status page (its URL with a token is printed)"
    )
    group.add_argument(
        "--status-host", default=LOCALHOST, metavar="HOST", help=f"address the page binds to (default: {LOCALHOST})"
    )


class Watch:
    """The servers a run was asked for, fed by the engine's progress callback; stop() frees their ports.

    ``history`` (``RunDir.metrics``) gives the rounds closed before this process; it is read only when a
    server is asked for, so a resumed run's charts and totals start from its first round.
    """

    def __init__(self, args: argparse.Namespace, history: Callable[[], list[RoundMetrics]]) -> None:
        self.servers: list[BackgroundServer] = []
        wanted = args.metrics_port is not None or args.status_port is not None
        self.fleet = FleetWatch(history() if wanted else [])
        try:
            if args.metrics_port is not None:
                self._serve_metrics(args.metrics_host, args.metrics_port)
            if args.status_port is not None:
                self._serve_status(args.status_host, args.status_port)
        except ObserveError:
            self.stop()
            raise

    def _serve_metrics(self, host: str, port: int) -> None:
        try:
            from coordinator.observe.metrics_server import serve_metrics
        except ImportError as exc:
            raise ObserveError(
                f"--metrics-port needs the prometheus-client package ({exc}): pip install 'fedfleet[coordinator]'"
            ) from exc
        server = serve_metrics(host, port, lambda: self.fleet.snapshot)
        self.servers.append(server)
        print(f"metrics: {server.url('/metrics')}", flush=True)

    def _serve_status(self, host: str, port: int) -> None:
        from coordinator.observe.status_server import StatusServer

        server = StatusServer(host, port, lambda: self.fleet.snapshot)
        self.servers.append(server)
        print(f"status page: {server.page_url}", flush=True)

    def update(self, engine: RoundEngine) -> None:
        if self.servers:
            self.fleet.update(engine)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
