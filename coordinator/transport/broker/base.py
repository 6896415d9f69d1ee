"""What every broker the coordinator manages offers, and the health check they share."""

from __future__ import annotations

import contextlib
import os
import random
import resource
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials
from device_agent.common.processes import die_with_parent
from device_agent.wire.session import BrokerAddress

MAX_CONNECTIONS = 1_000_000
"""mosquitto's ``max_connections`` on every fedfleet listener. Each connection holds one open file; one source
address can hold at most ~64k connections to one port (its source ports), so a flood from one host, or a few
(see docs/security.md for the per-source firewall limits), cannot fill it. The broker's open-file limit is
raised above it (:func:`raise_open_files`) where the system allows."""
FILES_RESERVED = 64
"""Open files a broker keeps for itself beyond its connections: listeners, persistence, log, password and ACL
files. ``max_connections`` below the open-file limit by this much keeps a flooded broker able to save its state."""
ONE_SOURCE = 65_536
"""The most connections one client address can hold to one port (its source ports): below this limit, one
host's flood can fill the broker."""
NR_OPEN = Path("/proc/sys/fs/nr_open")
"""The most open files the kernel lets root grant one process."""


class BrokerError(RuntimeError):
    """A broker that could not be started or does not answer."""


def raise_open_files(wanted: int = MAX_CONNECTIONS + FILES_RESERVED) -> int:
    """Raise this process's open-file limit toward ``wanted`` before it starts a broker, which inherits it.

    An inherited limit (1,024 from a login shell, 20,000 under some services) let that many idle TCP connections
    with no byte sent lock every device out of the broker. Root raises the hard limit too (up to the kernel's
    ``fs.nr_open``); anyone else gets the soft limit raised to the hard one. Returns the soft limit now.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted and os.geteuid() == 0:
        try:
            ceiling = int(NR_OPEN.read_text())
        except (OSError, ValueError):
            ceiling = wanted
        target = min(wanted, ceiling)
        with contextlib.suppress(OSError, ValueError):  # a container may forbid it: the soft raise below still helps
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), max(hard, target)))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def connection_limit(open_files: int, wanted: int = MAX_CONNECTIONS) -> int:
    """``max_connections`` for a broker with ``open_files``: ``wanted``, or what the limit leaves it."""
    return max(1, min(wanted, open_files - FILES_RESERVED))


@dataclass(frozen=True)
class BrokerSettings:
    """A managed broker for one fleet. ``port=0`` picks a free port.

    ``max_packet_bytes`` must exceed the transfer chunk size plus headers (the senders check it
    before publishing); ``max_queued_messages`` bounds what the broker keeps for an offline client:
    the protocol never relies on that queue, it only saves resends.
    """

    fleet: str
    workdir: Path
    credentials: dict[str, Credentials]
    host: str = "127.0.0.1"
    port: int = 0
    max_packet_bytes: int = 8 * 1024 * 1024
    max_queued_messages: int = 1000
    max_queued_bytes: int = 256 * 1024 * 1024
    max_connections: int = MAX_CONNECTIONS
    """mosquitto's ``max_connections``, lowered to what the open-file limit leaves where it cannot be raised."""
    extra_config: list[str] = field(default_factory=list)
    # mosquitto acl_file lines appended after the fleet's own (e.g. a benchmark's extra users).
    extra_acl: list[str] = field(default_factory=list)

    @property
    def coordinator(self) -> Credentials:
        return self.credentials[COORDINATOR_USER]


def queue_limits(devices: int) -> dict[str, int]:
    """``max_queued_messages`` and ``max_queued_bytes`` for a fleet of ``devices``.

    The coordinator's one session is sent every device's update of a round at once (a manifest, its chunks and
    its seal each): a queue sized for a handful of clients drops the excess, every sender then waits out its
    silence and sends again, and a 1,000-device round never completes. 16 messages and 1 MiB per device.
    """
    return {"max_queued_messages": max(1000, 16 * devices), "max_queued_bytes": max(256, devices) * 2**20}


class BrokerProcess:
    """What the brokers fedfleet runs as a child process share: that process, for the supervisor."""

    _process: subprocess.Popen[bytes] | None = None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The broker's process while we run it (for the supervisor)."""
        return self._process

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None


class ManagedBroker(Protocol):
    address: BrokerAddress
    # The MQTT version clients must speak to it ("5" or "3.1.1"): amqtt knows only 3.1.1.
    protocol: str

    def start(self, timeout: float = 10.0) -> None: ...

    def stop(self) -> None: ...

    def address_for(self, credentials: Credentials) -> BrokerAddress: ...


def terminate(process: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM (a broker saves its persistence on it), then SIGKILL if the process lingers."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def child_options(owner: tuple[int, int] | None = None) -> dict[str, Any]:
    """``Popen`` arguments for a broker that must not outlive us (:func:`die_with_parent`: SIGTERM when the
    coordinator dies, even by SIGKILL, so no orphan broker keeps the port): started directly as ``owner``
    (uid, gid), if given, so it has no user to drop and keeps its parent-death signal. Start brokers from
    the main thread: the signal follows the thread that started the child."""
    options: dict[str, Any] = {"preexec_fn": die_with_parent}
    if owner is not None:
        options |= {"user": owner[0], "group": owner[1], "extra_groups": []}
    return options


def check_port_free(host: str, port: int) -> None:
    """A ``BrokerError`` in one line when something already listens on ``host:port`` (an orphan broker?)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise BrokerError(
                f"port {port} on {host} is taken ({exc.strerror}): another broker, or one left by an earlier "
                "coordinator, is listening there; stop it or change transport.broker.port (fleet.yaml) "
                "or broker.port (agent.yaml)"
            ) from None


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux keeps the ports it hands out as clients' source ports."""


def ephemeral_ports() -> range:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port nothing listens on, chosen below the ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, which every outgoing
    connection draws its source port from: between releasing it and the broker binding it, one of the
    fleet's own client connections can take it ("Address already in use"). Ports below that range are
    only ever taken by listeners that ask for them by number.
    """
    ephemeral = ephemeral_ports()
    low = 20000 if ephemeral.start > 21000 else 1024
    high = ephemeral.start - 1 if ephemeral.start > low + 1000 else 65535
    rng = random.SystemRandom()
    for _ in range(tries):
        port = rng.randint(low, high)
        if port in ephemeral:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise BrokerError(f"no free port between {low} and {high} on {host} after {tries} tries")


def wait_until_healthy(address: BrokerAddress, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Log in as ``address``'s user until the broker accepts (CONNACK success) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise BrokerError(f"broker at {address.url} exited during start-up")
        last = probe(address, min(2.0, max(0.1, deadline - time.monotonic())))
        if last == "ok":
            return
        time.sleep(0.05)
    raise BrokerError(f"broker at {address.url} not healthy within {timeout} s: {last}")


def probe(address: BrokerAddress, timeout: float) -> str:
    """One login attempt: ``"ok"`` or why not."""
    result: list[str] = []
    done = threading.Event()

    def on_connect(_c: mqtt.Client, _u: object, _f: object, reason: object, _p: object) -> None:
        result.append("ok" if not reason.is_failure else f"refused: {reason}")
        done.set()

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fedfleet-health-{time.monotonic_ns()}")
    if address.username is not None:
        client.username_pw_set(address.username, address.password)
    if address.tls:
        client.tls_set(ca_certs=address.ca_file, certfile=address.cert_file, keyfile=address.key_file)
    client.on_connect = on_connect
    try:
        client.connect(address.host, address.port, keepalive=5)
    except OSError as exc:
        return f"cannot connect: {exc}"
    client.loop_start()
    try:
        done.wait(timeout)
    finally:
        client.disconnect()
        client.loop_stop()
    return result[0] if result else "no CONNACK"
