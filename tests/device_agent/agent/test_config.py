"""agent.yaml: defaults, flags over the file, password references, errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from device_agent.agent.config import ConfigError, load_config, parse_config
from device_agent.cli.app import build_parser
from device_agent.cli.run import config_from_args

SAMPLE = """\
device: pi5-01
fleet: demo
transport:
  kind: mqtt
  broker:
    url: mqtt://127.0.0.1:1883
    password: env:FEDFLEET_PASSWORD
    protocol: 5
data:
  dataset: digits
  partition: dirichlet(0.5)
  seed: 3
  index: 1
  count: 8
emulation:
  threads: 1
  memory_bytes: 2147483648
  slowdown: 4.0
"""


def test_the_sample_file_parses_and_yields_this_devices_partition(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(SAMPLE)
    config = load_config(path)
    assert config.broker.protocol == "5"
    spec = config.data.partition_spec()
    assert spec is not None and spec.scheme == "dirichlet" and spec.alpha == 0.5 and spec.num_clients == 8
    assert config.emulation is not None and config.emulation.slowdown == 4.0


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(SAMPLE)
    args = build_parser().parse_args(["run", "--config", str(path), "--device", "pi5-02", "--broker", "mqtt://h:1"])
    config = config_from_args(args)
    assert (config.device, config.broker.url, config.fleet) == ("pi5-02", "mqtt://h:1", "demo")
    assert config.broker.password == "env:FEDFLEET_PASSWORD"  # the file's, beside the flag's url


def test_a_top_level_broker_of_a_kit_in_the_field_is_read_as_moved_and_flags_still_win(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("device: pi5-01\nfleet: demo\nbroker: {url: 'mqtt://old:1883', password: 'file:password'}\n")
    args = build_parser().parse_args(["run", "--config", str(path), "--broker", "mqtt://new:1"])

    config = config_from_args(args)

    assert (config.broker.url, config.broker.password) == ("mqtt://new:1", f"file:{tmp_path / 'password'}")
    assert "the top-level `broker:` section is now `transport.broker:`" in caplog.text


def test_flags_alone_are_enough() -> None:
    args = build_parser().parse_args(["run", "--device", "x1", "--fleet", "f", "--partition", "permuted_labels"])
    config = config_from_args(args)
    assert config.data.partition == "permuted_labels" and config.data.partition_spec() is None


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"device": "a/b", "fleet": "f"}, "device"),
        ({"device": "a", "fleet": "f", "data": {"partition": "dirichlet(-1)"}}, "data.partition"),
        ({"device": "a", "fleet": "f", "transport": {"broker": {"password": "hunter2"}}}, "broker.password"),
        ({"device": "a", "fleet": "f", "emulation": {"slowdown": 0.5}}, "emulation.slowdown"),
        ({"device": "a", "fleet": "f", "transport": {"broker": {"keepalive_s": 0}}}, "broker.keepalive_s"),
        ({"device": "a", "fleet": "f", "data": {"dataset": "npz"}}, "data"),
        ({"device": "a", "fleet": "f", "colour": "red"}, "colour"),
    ],
)
def test_errors_name_the_key_path(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(raw)


def test_password_references_resolve_or_say_what_is_missing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AGENT_SECRET", "s3cret")
    assert (
        parse_config(
            {"device": "a", "fleet": "f", "transport": {"broker": {"password": "env:AGENT_SECRET"}}}
        ).broker.resolve_password()
        == "s3cret"
    )
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    config = parse_config({"device": "a", "fleet": "f", "transport": {"broker": {"password": f"file:{secret}"}}})
    assert config.broker.resolve_password() == "from-file"
    monkeypatch.delenv("AGENT_SECRET")
    with pytest.raises(ConfigError, match="AGENT_SECRET"):
        parse_config(
            {"device": "a", "fleet": "f", "transport": {"broker": {"password": "env:AGENT_SECRET"}}}
        ).broker.resolve_password()


def test_relative_paths_in_the_file_are_relative_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "etc" / "agent.yaml"
    path.parent.mkdir()
    path.write_text(
        "device: pi5-01\nfleet: demo\n"
        "broker: {url: 'mqtts://broker:8883', password: 'file:password', ca_file: ca.pem,"
        " cert_file: certs/client.pem, key_file: /abs/client.key}\n"
        "data: {dataset: npz, path: ../data/train.npz}\n"
    )
    monkeypatch.chdir("/")

    config = load_config(path)

    assert config.state_dir == tmp_path / "etc" / "agent-state"
    assert config.broker.password == f"file:{tmp_path / 'etc' / 'password'}"
    assert (config.broker.ca_file, config.broker.cert_file) == (
        str(tmp_path / "etc" / "ca.pem"),
        str(tmp_path / "etc" / "certs" / "client.pem"),
    )
    assert config.broker.key_file == "/abs/client.key"
    assert Path(config.data.path or "").resolve() == tmp_path / "data" / "train.npz"


def test_flags_stay_relative_to_the_working_directory(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("device: pi5-01\nfleet: demo\nstate_dir: state\n")

    config = load_config(path, {"state_dir": "elsewhere"})

    assert config.state_dir == Path("elsewhere")


def test_the_signing_key_is_a_reference_resolved_at_start(tmp_path, monkeypatch) -> None:
    key = bytes(range(32))
    monkeypatch.setenv("PI_SIGNING_KEY", key.hex())
    config = parse_config({"device": "pi-1", "fleet": "lab", "signing_key": "env:PI_SIGNING_KEY"})
    assert config.resolve_signing_key() == key
    assert parse_config({"device": "pi-1", "fleet": "lab"}).resolve_signing_key() is None
    (tmp_path / "short.key").write_text("00ff")
    short = parse_config({"device": "pi-1", "fleet": "lab", "signing_key": f"file:{tmp_path / 'short.key'}"})
    with pytest.raises(ConfigError, match=r"signing_key: file:.*short\.key: 2 bytes, at least 16 needed"):
        short.resolve_signing_key()
    with pytest.raises(ConfigError, match="never the secret itself"):
        parse_config({"device": "pi-1", "fleet": "lab", "signing_key": key.hex()})
