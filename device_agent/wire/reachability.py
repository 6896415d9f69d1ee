"""Why a broker cannot be reached, in words: a name that does not resolve, a port nobody listens on.

paho retries a failed connection in silence; an agent pointed at the wrong host or port then says
nothing after "connecting", even at DEBUG. A plain TCP connect names the cause, so the agent can
say it, retry with backoff, and give up with an exit code instead of waiting forever.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

log = logging.getLogger("fedfleet.wire")

MAX_BACKOFF_S = 30.0


def why_unreachable(host: str, port: int, timeout: float = 3.0) -> str | None:
    """None when a TCP connection to ``host:port`` opens, else the reason in a few words."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"the host name {host!r} does not resolve ({exc.strerror})"
    reasons = []
    for family, kind, proto, _name, address in addresses:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(address)
            return None
        except ConnectionRefusedError:
            reasons.append(f"nothing is listening on {host}:{port} (connection refused)")
        except TimeoutError:
            reasons.append(f"{host}:{port} does not answer within {timeout:g} s (a firewall, or the wrong host)")
        except OSError as exc:
            reasons.append(f"{host}:{port}: {exc.strerror or exc}")
    return reasons[0] if reasons else f"{host!r} has no address"


def wait_for_broker(
    host: str,
    port: int,
    give_up_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    what: str = "the broker",
) -> None:
    """Return once ``host:port`` accepts a connection; retry with backoff, each failure logged with its cause.

    Raises ``ConnectionError`` naming the cause once ``give_up_s`` seconds would be exceeded.
    """
    started, delay = clock(), 1.0
    while (why := why_unreachable(host, port)) is not None:
        waited = clock() - started
        if waited + delay > give_up_s:
            raise ConnectionError(f"cannot reach {what} at {host}:{port}: {why}; gave up after {waited:.0f} s")
        log.warning("cannot reach %s at %s:%d: %s; retrying in %.0f s", what, host, port, why, delay)
        sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)
