"""The WebSocket carrier over real TLS sockets: the coordinator's server and devices' clients in this process.

Certificates come from the fleet's own CA as provisioning makes them (``coordinator.provision.certificates``);
a second CA stands for another fleet's kit.
"""

from __future__ import annotations

import base64
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from websockets.sync.client import connect

from coordinator.config.fleet import parse_fleet
from coordinator.provision.certificates import Authority
from coordinator.provision.layout import Kits
from coordinator.transport.broker.base import free_port
from coordinator.transport.registry import transport_of
from coordinator.transport.websocket.server import ServerTls, WsServer
from device_agent.cli import doctor
from device_agent.wire.engine import Completed
from device_agent.wire.messages import Error, Message, Status, encode
from device_agent.wire.websocket.client import Dial, WsClient
from device_agent.wire.websocket.endpoint import Endpoint, WsSettings

FLEET = "wst"
DEVICES = ("d0", "d1")
PASSWORDS = {"d0": "secret-zero", "d1": "secret-one"}


@dataclass
class Certificates:
    folder: Path
    ca: str
    server: tuple[str, str]
    clients: dict[str, tuple[str, str]]
    foreign_ca: str
    foreign: tuple[str, str]
    """A certificate for d0 signed by another fleet's CA."""


def _write(folder: Path, name: str, pair: tuple[bytes, bytes]) -> tuple[str, str]:
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    cert.write_bytes(pair[0])
    key.write_bytes(pair[1])
    return str(cert), str(key)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    folder = tmp_path_factory.mktemp("ws-certs")
    ours, theirs = Authority(Kits(folder / "ours"), FLEET), Authority(Kits(folder / "theirs"), "other")
    return Certificates(
        folder,
        str(ours.folder / "ca.pem"),
        _write(folder, "server", ours.issue("server", ["localhost", "127.0.0.1"])),
        {d: _write(folder, d, ours.issue(d)) for d in DEVICES},
        str(theirs.folder / "ca.pem"),
        _write(folder, "foreign", theirs.issue("d0")),
    )


@dataclass
class Heard:
    """What the coordinator's handlers were told, and an event per arrival."""

    messages: list[tuple[str, Message]] = field(default_factory=list)
    payloads: list[tuple[str, Completed]] = field(default_factory=list)
    refusals: list[tuple[str, str]] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def add(self, kind: list, item: object) -> None:
        with self.changed:
            kind.append(item)
            self.changed.notify_all()

    def wait(self, what: str, condition: Callable[[], bool], timeout: float = 60.0) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, timeout), f"no {what} within {timeout} s: {self}"


@pytest.fixture
def server(certificates: Certificates) -> Iterator[tuple[WsServer, Heard]]:
    tls = ServerTls(*certificates.server, certificates.ca)
    served = WsServer(FLEET, "127.0.0.1", free_port(), PASSWORDS, tls, WsSettings(chunk_size=64 * 1024))
    heard = Heard()
    served.start()
    served.attach(
        lambda d, m: heard.add(heard.messages, (d, m)),
        lambda d, c: heard.add(heard.payloads, (d, c)),
        lambda d, r: heard.add(heard.refusals, (d, r)),
    )
    yield served, heard
    served.stop()


def device(
    served: WsServer,
    certificates: Certificates,
    name: str = "d0",
    as_: str | None = None,
    cert: tuple[str, str] | None = None,
    ca: str | None = None,
    password: str | None = None,
    **settings: object,
) -> tuple[WsClient, list[Completed]]:
    """A device's client dialling ``served`` as ``as_`` (default: itself) with its own certificate unless told."""
    cert = cert or certificates.clients[name]
    dial = Dial(served.url, FLEET, as_ or name, password or PASSWORDS[name], ca or certificates.ca, *cert)
    received: list[Completed] = []
    endpoint = Endpoint(
        f"device-{name}", WsSettings(chunk_size=64 * 1024, **settings), on_payload=lambda _r, c: received.append(c)
    )
    client = WsClient(dial, endpoint)
    client.start()
    return client, received


def wait(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_device_and_the_coordinator_exchange_messages_and_payloads_over_tls(server, certificates) -> None:
    served, heard = server
    client, received = device(served, certificates)
    try:
        assert client.connected.wait(60), client.connect_failure
        status = Status(device="d0", state="idle")
        client.endpoint.publish("coordinator", status)
        heard.wait("status", lambda: bool(heard.messages))
        assert heard.messages[0] == ("d0", status)

        model = bytes(range(256)) * 1200  # 300 KiB: five chunks of 64 KiB
        served.endpoint.send("d0", model, run="r", round=1, kind="model").wait(60)
        wait(lambda: bool(received))
        assert received[0].data == model and received[0].manifest.kind == "model"

        update = b"\x07" * 200_000
        client.endpoint.send("coordinator", update, run="r", round=1, kind="update").wait(60)
        heard.wait("upload", lambda: bool(heard.payloads))
        ((sender, completed),) = heard.payloads
        assert sender == "d0" and completed.data == update
    finally:
        client.stop()


def test_an_upload_cut_off_by_a_lost_connection_resumes_after_the_reconnect(server, certificates) -> None:
    served, heard = server
    sent = threading.Semaphore(0)
    client, _ = device(served, certificates, reconnect_min_s=0.2)
    client.endpoint._before_chunk_out = lambda _n: (sent.release(), time.sleep(0.01))
    try:
        assert client.connected.wait(60), client.connect_failure
        update = bytes(range(251)) * 8000  # ~2 MB: 31 chunks, paced at 10 ms each
        delivery = client.endpoint.send("coordinator", update, run="r", round=1, kind="update")
        for _ in range(8):
            assert sent.acquire(timeout=60)
        served._connections["d0"].close(1011, "test: connection lost mid-transfer")
        delivery.wait(60)
        heard.wait("upload", lambda: bool(heard.payloads))
        assert [(d, c.data == update) for d, c in heard.payloads] == [("d0", True)]  # once, whole
        assert client.endpoint.stats.connects == 2
        said = [(d, m.state, m.detail) for d, m in heard.messages if isinstance(m, Status)]
        assert ("d0", "offline", "connection lost") in said  # the server's last will for the lost connection
    finally:
        client.stop()


def test_a_certificate_of_another_fleet_is_refused_with_a_clear_error(server, certificates, caplog) -> None:
    served, _ = server
    caplog.set_level(logging.WARNING, "fedfleet.websocket")
    client, _ = device(served, certificates, cert=certificates.foreign)
    try:
        wait(lambda: client.connect_failure is not None)
        assert not client.connected.is_set()
        assert "TLS handshake" in client.connect_failure and "client certificate" in client.connect_failure
        wait(lambda: "refused a TLS connection from 127.0.0.1" in caplog.text)
        assert "certificate" in caplog.text.lower()
    finally:
        client.stop()


def test_a_device_refuses_a_server_its_ca_did_not_sign(server, certificates) -> None:
    served, _ = server
    client, _ = device(served, certificates, ca=certificates.foreign_ca)
    try:
        wait(lambda: client.connect_failure is not None)
        assert "TLS" in client.connect_failure and "CA" in client.connect_failure, client.connect_failure
        assert not client.connected.is_set()
    finally:
        client.stop()


def test_a_device_cannot_speak_for_another(server, certificates, caplog) -> None:
    served, heard = server
    caplog.set_level(logging.WARNING, "fedfleet.websocket")
    impostor, _ = device(served, certificates, "d0", as_="d1", password=PASSWORDS["d1"])  # d0's certificate
    wrong_password, _ = device(served, certificates, "d1", password=PASSWORDS["d0"])
    try:
        wait(lambda: impostor.refused is not None and wrong_password.refused is not None)
        assert "HTTP 403" in impostor.refused and "certificate of 'd0' cannot connect as 'd1'" in impostor.refused
        assert "HTTP 401" in wrong_password.refused and "password" in wrong_password.refused
        assert "refused a connection from 127.0.0.1" in caplog.text

        honest, _ = device(served, certificates, "d0")
        try:
            assert honest.connected.wait(60), honest.connect_failure
            # Whatever it claims, a frame on d0's connection is d0's: the roster ignores a status naming another.
            claim = Status(device="d1", state="offline", detail="d0 says so")
            honest.endpoint.publish("coordinator", claim)
            heard.wait("the claim", lambda: bool(heard.messages))
            assert heard.messages[0] == ("d0", claim)
        finally:
            honest.stop()
    finally:
        impostor.stop()
        wrong_password.stop()


def test_malformed_frames_are_refused_logged_and_the_connection_goes_on(server, certificates, caplog) -> None:
    served, heard = server
    caplog.set_level(logging.WARNING, "fedfleet.wire")
    context = ssl.create_default_context(cafile=certificates.ca)
    context.load_cert_chain(*certificates.clients["d0"])
    login = base64.b64encode(f"d0:{PASSWORDS['d0']}".encode()).decode()
    with connect(
        f"{served.url}/{FLEET}/d0", ssl=context, additional_headers={"Authorization": f"Basic {login}"}
    ) as raw:
        raw.send(b"not json at all")
        raw.send("a text message")
        raw.send(b'{"v": 3, "type": "bogus"}')
        raw.send(b"FFCK\x02too short")
        raw.send(b'{"v": 99, "type": "status"}')
        answer = Error.model_validate_json(raw.recv(timeout=60))
        raw.send(encode(Status(device="d0", state="idle")))
        heard.wait("the status after the garbage", lambda: any(isinstance(m, Status) for _, m in heard.messages))
    reasons = [reason for device_, reason in heard.refusals if device_ == "d0"]
    assert reasons.count("malformed") == 4 and reasons.count("wrong_version") == 1, reasons
    assert answer.code == "incompatible" and "protocol version 99" in answer.detail
    assert "refusing input from d0 (malformed)" in caplog.text and "not JSON" in caplog.text
    assert not heard.payloads


def test_fleet_and_agent_settings_of_the_websocket_transport_are_checked_with_their_keys() -> None:
    def fleet(transport: dict) -> object:
        return parse_fleet({"fleet": FLEET, "transport": transport, "devices": [{"id": "d0", "profile": "reported"}]})

    good = fleet({"kind": "websocket", "port": 9443, "hosts": ["coord.example.org"]})
    kind = transport_of(good)
    assert kind.problems(good) == []
    assert kind.dial_url(good) == "wss://coord.example.org:9443"
    assert kind.server_names(good) == ["coord.example.org", "localhost", "127.0.0.1"]
    typo = fleet({"kind": "websocket", "prot": 9443})
    assert kind.problems(typo) == ["transport.prot: Extra inputs are not permitted (did you mean 'port'?)"]
    assert kind.problems(fleet({"kind": "websocket", "port": 0}))[0].startswith("transport.port: ")
    mqtt = fleet({"kind": "mqtt", "port": 9443})
    assert transport_of(mqtt).problems(mqtt)[0] == (
        "transport.port: not a setting of transport 'mqtt' (it takes kind and broker)"
    )


def test_doctor_checks_the_way_and_the_login_without_taking_over_a_running_agent(
    server, certificates, tmp_path
) -> None:
    served, _ = server
    (tmp_path / "password").write_text(PASSWORDS["d0"])
    (tmp_path / "wrong").write_text(PASSWORDS["d1"])
    cert, key = certificates.clients["d0"]

    def agent_yaml(password: str) -> Path:
        path = tmp_path / f"{password}.yaml"
        path.write_text(
            f"device: d0\nfleet: {FLEET}\ndata: {{dataset: digits}}\n"
            f"transport: {{kind: websocket, url: '{served.url}', password: 'file:{tmp_path / password}', "
            f"ca_file: {certificates.ca}, cert_file: {cert}, key_file: {key}}}\n"
        )
        return path

    running, _ = device(served, certificates)
    try:
        assert running.connected.wait(60), running.connect_failure
        wait(lambda: served.endpoint.connected("d0"))
        connection = served._connections["d0"]
        checks = {c.name: c for c in doctor.diagnose(agent_yaml("password"))}
        refused = {c.name: c for c in doctor.diagnose(agent_yaml("wrong"))}
        assert served._connections["d0"] is connection and running.endpoint.stats.connects == 1  # not taken over
    finally:
        running.stop()

    assert [
        (n, checks[n].ok) for n in ("secrets readable", "coordinator reachable", "TLS verifies", "login accepted")
    ] == [(n, True) for n in ("secrets readable", "coordinator reachable", "TLS verifies", "login accepted")]
    assert checks["login accepted"].detail == f"as d0: d0 may connect to fleet {FLEET}"
    assert refused["login accepted"].ok is False and "HTTP 401" in refused["login accepted"].detail


def test_a_second_connection_of_a_device_replaces_the_first_and_a_clean_stop_is_not_a_lost_connection(
    server, certificates
) -> None:
    served, heard = server
    first, _ = device(served, certificates, reconnect_min_s=30)  # it would come back only after the test
    assert first.connected.wait(60), first.connect_failure
    second, _ = device(served, certificates)
    try:
        assert second.connected.wait(60), second.connect_failure
        wait(lambda: not first.connected.is_set())  # closed by the server: replaced (code 4000)
        assert served.endpoint.connected("d0") and served._connections["d0"].remote_address
        said = [(d, m.state) for d, m in heard.messages if isinstance(m, Status)]
        assert ("d0", "offline") not in said  # the device never left: its newer connection took over
        stopped = Status(device="d0", state="offline", detail="stopped")
        second.endpoint.publish("coordinator", stopped)  # what WsPort.stop says before it closes
    finally:
        second.stop()
        first.stop()
    heard.wait("the stop", lambda: any(isinstance(m, Status) for _, m in heard.messages))
    time.sleep(0.5)  # a lost-connection status would follow the close at once
    assert [m for _, m in heard.messages if isinstance(m, Status)] == [stopped]
