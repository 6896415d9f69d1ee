"""The --metrics-port / --status-port options: off by default, clear errors, servers gone after stop()."""

from __future__ import annotations

import argparse
import threading
import urllib.request
from pathlib import Path

import pytest

from coordinator.cli.app import main
from coordinator.observe import ObserveError, Watch, add_observe_arguments
from coordinator.observe.serving import BackgroundServer, ReadOnlyHandler


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_observe_arguments(parser)
    return parser.parse_args(argv)


def test_both_servers_are_off_unless_asked_and_bind_to_localhost() -> None:
    args = options()
    assert (args.metrics_port, args.status_port) == (None, None)
    assert (args.metrics_host, args.status_host) == ("127.0.0.1", "127.0.0.1")
    assert Watch(args, list).servers == []


def test_start_and_emulate_document_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("start", "emulate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "--metrics-port PORT" in out and "--status-port PORT" in out and "--metrics-host HOST" in out


@pytest.mark.parametrize(("port", "message"), [("70000", "out of range"), ("nine", "is not a port number")])
def test_a_bad_port_is_a_usage_error_that_names_it(port: str, message: str, capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["start", "--fleet", str(tmp_path / "fleet.yaml"), "--metrics-port", port])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_taken_port_names_the_server_and_stops_the_one_already_started(capsys) -> None:
    taken = BackgroundServer("test", "127.0.0.1", 0, ReadOnlyHandler)
    try:
        before = set(threading.enumerate())
        with pytest.raises(ObserveError, match=rf"cannot serve the status page on 127.0.0.1:{taken.address[1]}"):
            Watch(options("--metrics-port", "0", "--status-port", str(taken.address[1])), list)
        metrics_url = capsys.readouterr().out.split("metrics: ")[1].strip()
        with pytest.raises(OSError):
            urllib.request.urlopen(metrics_url, timeout=5)  # the metrics server was stopped again
        assert set(threading.enumerate()) <= before
    finally:
        taken.stop()


def test_stop_leaves_no_thread_and_no_port() -> None:
    before = set(threading.enumerate())
    watch = Watch(options("--metrics-port", "0", "--status-port", "0"), list)
    urls = [server.url("/") for server in watch.servers]
    assert len(urls) == 2 and set(threading.enumerate()) > before
    watch.stop()
    assert set(threading.enumerate()) <= before
    for url in urls:
        with pytest.raises(OSError):
            urllib.request.urlopen(url, timeout=5)
