"""The ``--status-port`` page: a fleet table, the open round and charts, polled from a JSON snapshot.

Everything it serves ships in the package (``coordinator/observe/static``): no CDN, so it works on an
air-gapped fleet network. The page and the data need the random token printed once at start (the URL
carries it); the static script and style hold nothing of the run and are served without it.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Callable
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from coordinator.observe.serving import BackgroundServer, ReadOnlyHandler
from coordinator.observe.snapshot import Snapshot

_ASSETS = {
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}
_PAGE = ("status.html", "text/html; charset=utf-8")
_CSP = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"


def _asset(name: str) -> bytes:
    return resources.files("coordinator.observe").joinpath("static", name).read_bytes()


class StatusServer(BackgroundServer):
    """Serves ``/?token=...`` (the page), ``/api/status?token=...`` (the snapshot as JSON) and the assets."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], Snapshot | None]) -> None:
        self.token = secrets.token_urlsafe(18)
        token = self.token
        assets = {path: (_asset(name), kind) for path, (name, kind) in {**_ASSETS, "/": _PAGE}.items()}

        class Handler(ReadOnlyHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path in _ASSETS:
                    self.reply(200, *assets[url.path])
                    return
                if url.path not in ("/", "/api/status"):
                    self.reply(404, b"not found\n", "text/plain; charset=utf-8")
                    return
                given = parse_qs(url.query).get("token", [""])[0]
                if not hmac.compare_digest(given.encode(), token.encode()):
                    self.reply(403, b"missing or wrong token: open the URL the coordinator printed at start\n",
                               "text/plain; charset=utf-8")  # fmt: skip
                    return
                if url.path == "/":
                    self.reply(200, *assets["/"])
                    return
                current = snapshot()
                body = {"waiting": True} if current is None else current.as_json()
                self.reply(200, json.dumps(body).encode(), "application/json")

            def end_headers(self) -> None:
                self.send_header("Content-Security-Policy", _CSP)
                super().end_headers()

        super().__init__("status page", host, port, Handler)

    @property
    def page_url(self) -> str:
        return self.url(f"/?token={self.token}")
