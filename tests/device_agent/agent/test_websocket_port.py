"""agent.yaml's ``transport: {kind: websocket, ...}``: settings checked with their keys, files found in a kit."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_agent.agent.config import ConfigError, load_kit, parse_config
from device_agent.agent.port_kinds.websocket import WsPort
from device_agent.agent.ports import port_kind_of


def config(**transport: object):
    return parse_config({"device": "pi-1", "fleet": "lab", "transport": {"kind": "websocket", **transport}})


def test_a_websocket_port_is_made_from_its_url_and_claims_one_login_on_one_coordinator() -> None:
    settings = config(url="wss://coord.example.org:8443", password="env:HOME")
    kind = port_kind_of(settings)

    assert isinstance(kind.port(settings), WsPort)
    assert kind.claim_key(settings) == "websocket:coord.example.org:8443/lab/pi-1"
    assert kind.port(settings).dial.uri == "wss://coord.example.org:8443/lab/pi-1"


@pytest.mark.parametrize(
    ("transport", "problem"),
    [
        ({}, "transport.url: Field required"),
        ({"url": "https://coord:8443"}, "transport.url: must look like wss://host:port, got 'https://coord:8443'"),
        ({"url": "wss://coord:8443/lab"}, "transport.url: 'wss://coord:8443/lab': no path"),
        ({"url": "wss://coord:x"}, "transport.url: 'wss://coord:x': the port must be a number from 1 to 65535"),
        (
            {"url": "wss://coord:8443", "ulr": "x"},
            "transport.ulr: Extra inputs are not permitted (did you mean 'url'?)",
        ),
        ({"url": "wss://coord:8443", "cert_file": "c.pem"}, "transport.cert_file and transport.key_file go together"),
        ({"url": "ws://coord:80", "cert_file": "c.pem", "key_file": "k"}, "needs a wss:// url"),
        ({"url": "wss://coord:8443", "password": "hunter2"}, "transport.password: "),
    ],
)
def test_each_bad_setting_is_refused_at_start_naming_its_key(transport: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as refused:
        port_kind_of(config(**transport))
    assert problem in str(refused.value)


def test_a_kit_run_where_it_lies_finds_its_certificates_and_password_in_the_folder(tmp_path: Path) -> None:
    for name in ("ca.pem", "client.pem", "client.key", "password"):
        (tmp_path / name).write_text(name)
    (tmp_path / "agent.yaml").write_text(
        "device: pi-1\nfleet: lab\ntransport: {kind: websocket, url: 'wss://coord:8443', "
        "password: 'file:/opt/fedfleet/etc/password', ca_file: /opt/fedfleet/etc/ca.pem, "
        "cert_file: /opt/fedfleet/etc/client.pem, key_file: /opt/fedfleet/etc/client.key}\n"
    )

    settings = load_kit(tmp_path).transport.model_extra or {}

    assert settings["ca_file"] == str(tmp_path / "ca.pem") and settings["key_file"] == str(tmp_path / "client.key")
    assert settings["password"] == f"file:{tmp_path / 'password'}"
