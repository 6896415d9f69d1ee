"""A flood of idle TCP connections (no byte sent, held open) does not lock a device out of the managed broker.

Scaled down from the attack that did (19,900 idle connections against an inherited open-file limit of 20,000):
the coordinator inherits a limit of 256 and 400 idle connections are held. Started the way it was before,
mosquitto inherits the 256 and the device's login gets no answer; started by ``MosquittoBroker``, which raises
the limit it passes on (and sets ``max_connections`` below it), the device logs in. What one source address
can hold is bounded by its source ports; more sources are the firewall's to limit (docs/security.md).
"""

from __future__ import annotations

import resource
import socket
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from coordinator.transport.broker.base import (
    FILES_RESERVED,
    MAX_CONNECTIONS,
    BrokerSettings,
    probe,
    terminate,
    wait_until_healthy,
)
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, _broker_owner, find_mosquitto
from coordinator.transport.broker.scratch import scratch_dir
from device_agent.common.processes import die_with_parent

INHERITED = 256
FLOOD = 400

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


@contextmanager
def inherited_limit(files: int) -> Iterator[None]:
    """This process's soft open-file limit at ``files`` for a while, as a login shell or a service might set it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, hard))
    try:
        yield
    finally:
        now_soft, now_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, now_soft), now_hard))


def flood(port: int, count: int) -> ExitStack:
    """``count`` TCP connections to the broker that send nothing, held until the stack closes."""
    held = ExitStack()
    for _ in range(count):
        try:
            held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=2))
        except OSError:
            break  # the broker's backlog is full: what it holds is the flood
    return held


def open_files_of(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


@pytest.mark.slow
def test_a_flood_of_idle_connections_locks_a_device_out_of_a_broker_left_at_its_inherited_limit() -> None:
    """The attack, scaled down: the control that shows the flood is big enough to lock a device out."""
    credentials = generate_credentials(["d0"])
    broker = MosquittoBroker(BrokerSettings("flood", scratch_dir("fedfleet-broker-"), credentials))
    broker.write_files()

    def at_inherited_limit() -> None:
        die_with_parent()
        resource.setrlimit(resource.RLIMIT_NOFILE, (INHERITED, INHERITED))

    owner = _broker_owner()
    user = {} if owner is None else {"user": owner[0], "group": owner[1], "extra_groups": []}
    process = subprocess.Popen(
        [broker.binary, "-c", str(broker.config_file)], stderr=subprocess.DEVNULL, preexec_fn=at_inherited_limit, **user
    )
    try:
        wait_until_healthy(broker.address, 10, alive=lambda: process.poll() is None)
        with flood(broker.port, FLOOD):
            locked_out = probe(broker.address_for(credentials["d0"]), 5)
    finally:
        terminate(process, 10)
    assert locked_out != "ok"


@pytest.mark.slow
def test_a_flood_of_idle_connections_does_not_lock_a_device_out_of_the_managed_broker() -> None:
    credentials = generate_credentials(["d0"])
    broker = MosquittoBroker(BrokerSettings("flood", scratch_dir("fedfleet-broker-"), credentials))
    with inherited_limit(INHERITED):
        broker.start()
    try:
        files = open_files_of(broker._process.pid)  # type: ignore[union-attr]
        config = broker.config_file.read_text()
        with flood(broker.port, FLOOD) as _held:
            device = probe(broker.address_for(credentials["d0"]), 5)
    finally:
        broker.stop()
    assert files > FLOOD + FILES_RESERVED
    assert f"max_connections {min(MAX_CONNECTIONS, files - FILES_RESERVED)}\n" in config
    assert device == "ok"
