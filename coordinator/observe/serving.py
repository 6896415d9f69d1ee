"""Small read-only HTTP servers on daemon threads that stop cleanly (port freed, thread joined)."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("fedfleet.observe")


class ObserveError(Exception):
    """An observer cannot start (port taken, bad address); the message names the server and address."""


class ReadOnlyHandler(BaseHTTPRequestHandler):
    """GET and HEAD only: nothing an observer serves may change the run."""

    server_version = "fedfleet"
    sys_version = ""
    timeout = 10.0
    """Seconds a connection may stay silent before it is closed: slow clients (400 of them) cannot each hold a
    thread for good. A browser or curl sends its request at once; keep-alive is off (HTTP/1.0)."""

    def do_HEAD(self) -> None:
        self.do_GET()

    def _refuse_write(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_PATCH = do_DELETE = _refuse_write

    def reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class BackgroundServer:
    """A ThreadingHTTPServer bound now (so a taken port fails at start) and served on a daemon thread."""

    def __init__(self, what: str, host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        try:
            self._server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ObserveError(f"cannot serve the {what} on {host}:{port}: {exc.strerror or exc}") from exc
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"fedfleet-{what}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def url(self, path: str = "/") -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
