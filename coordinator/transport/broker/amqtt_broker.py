"""The development fallback: amqtt (pure Python) in a child process, authenticated and confined.

Use it only where mosquitto is not installed: amqtt speaks MQTT 3.1.1 only, is several times
slower, holds about 8x a message in memory, has no packet size limit and loses messages queued for
offline clients (the wire protocol's resends cover that). It reads the same ``$7$`` password file
as mosquitto and enforces the same per-device confinement as mosquitto's pattern ACLs, through the
two plugins below. Run it as ``python -m coordinator.transport.broker.amqtt_broker CONFIG.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin

from coordinator.transport.broker.base import (
    BrokerError,
    BrokerProcess,
    BrokerSettings,
    check_port_free,
    child_options,
    free_port,
    terminate,
    wait_until_healthy,
)
from coordinator.transport.broker.credentials import (
    COORDINATOR_USER,
    Credentials,
    read_password_file,
    verify_password,
    write_password_file,
    write_private,
)
from device_agent.wire.session import BrokerAddress
from device_agent.wire.topics import ROOT, UPLINK_SUBTOPICS, check_name

log = logging.getLogger("fedfleet.broker")

WARNING = (
    "mosquitto is not installed: using the amqtt fallback broker (MQTT 3.1.1 only, slower, loses offline "
    "queues, no packet size limit). Fine for development; install mosquitto for a real fleet."
)


def covers(allowed: str, requested: str) -> bool:
    """Whether every topic matched by ``requested`` (a topic or filter) is matched by ``allowed``.

    A wildcard in the request is only covered by a wildcard of the grant: a device asking for
    ``.../dev/+/down/#`` is not covered by ``.../dev/a/down/#``.
    """
    grant, want = allowed.split("/"), requested.split("/")
    for i, level in enumerate(grant):
        if level == "#":
            return True
        if i >= len(want):
            return False
        if want[i] == "#" or (want[i] == "+" and level != "+"):
            return False
        if level not in ("+", want[i]):
            return False
    return len(want) == len(grant)


class FleetPasswordAuth(BaseAuthPlugin):
    """Accepts only users of the ``$7$`` password file with the right password."""

    @dataclass
    class Config:
        password_file: str = ""

    def __init__(self, context: object) -> None:
        super().__init__(context)
        self._users = read_password_file(Path(self.config.password_file))

    async def authenticate(self, *, session: object) -> bool:
        username, password = getattr(session, "username", None), getattr(session, "password", None)
        hashed = self._users.get(username or "")
        return hashed is not None and verify_password(password or "", hashed)


class FleetTopicAcl(BaseTopicPlugin):
    """mosquitto's fedfleet ACLs: a device writes its ``up/data`` and ``up/status`` and reads its ``down/data``."""

    @dataclass
    class Config:
        fleet: str = ""

    async def topic_filtering(self, *, session: object = None, topic: str | None = None, action: object = None) -> bool:
        username = getattr(session, "username", None)
        if not username or topic is None:
            return False
        fleet_root = f"{ROOT}/{self.config.fleet}"
        if username == COORDINATOR_USER:
            return covers(f"{fleet_root}/#", topic)
        try:
            check_name("device", username)
        except ValueError:
            return False
        base = f"{fleet_root}/dev/{username}"
        grants = [f"{base}/up/{sub}" for sub in UPLINK_SUBTOPICS] if action == Action.PUBLISH else [f"{base}/down/data"]
        return any(covers(grant, topic) for grant in grants)


def amqtt_config(settings: BrokerSettings, port: int, password_file: Path) -> dict:
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{settings.host}:{port}"}},
        "plugins": {
            f"{__name__}.FleetPasswordAuth": {"password_file": str(password_file)},
            f"{__name__}.FleetTopicAcl": {"fleet": check_name("fleet", settings.fleet)},
        },
    }


class AmqttBroker(BrokerProcess):
    """Same interface as ``MosquittoBroker``; the broker runs in a child Python process."""

    protocol = "3.1.1"  # amqtt 0.12 refuses MQTT 5 CONNECTs

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self.port = settings.port or free_port(settings.host)
        self.workdir = settings.workdir
        self.config_file = self.workdir / "amqtt.json"
        self.log_file = self.workdir / "amqtt.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> BrokerAddress:
        return self.address_for(self.settings.coordinator)

    def address_for(self, credentials: Credentials) -> BrokerAddress:
        return BrokerAddress(self.settings.host, self.port, credentials.username, credentials.password)

    def start(self, timeout: float = 20.0) -> None:
        if self.running:
            return
        check_port_free(self.settings.host, self.port)
        self.workdir.mkdir(parents=True, exist_ok=True)
        password_file = self.workdir / "passwd"
        write_password_file(password_file, self.settings.credentials)
        write_private(self.config_file, json.dumps(amqtt_config(self.settings, self.port, password_file), indent=2))
        with open(self.log_file, "ab") as log_out:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.config_file)],
                stdout=log_out,
                stderr=subprocess.STDOUT,
                **child_options(),
            )
        try:
            wait_until_healthy(self.address, timeout, alive=lambda: self.running)
        except BrokerError:
            self.stop()
            raise
        log.info("amqtt (pid %d) listening on %s", self._process.pid, self.address.url)

    def stop(self, timeout: float = 10.0) -> None:
        terminate(self._process, timeout)
        self._process = None


async def _serve(config: dict) -> None:
    broker = Broker(config)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await broker.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m coordinator.transport.broker.amqtt_broker CONFIG.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
