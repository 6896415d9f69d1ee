"""The command lines' error boundary: one line and an exit code for a user's mistake, a traceback for a bug."""

from __future__ import annotations

import pytest
import torch

from device_agent.agent.config import ConfigError
from device_agent.cli.app import main
from device_agent.cli.errors import describe, guarded


def _raise(exc: BaseException):
    def run() -> int:
        raise exc

    return run


def test_a_user_error_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code = guarded("tool", _raise(ConfigError("agent.yaml: broker.url: bad")), (ConfigError,), debug=False)

    assert code == 1
    assert capsys.readouterr().err == "tool: error: agent.yaml: broker.url: bad\n"


def test_a_bug_keeps_its_traceback_and_debug_shows_a_user_errors_too() -> None:
    with pytest.raises(KeyError):
        guarded("tool", _raise(KeyError("bug")), (ConfigError,), debug=False)
    with pytest.raises(ConfigError):
        guarded("tool", _raise(ConfigError("bad")), (ConfigError,), debug=True)


def test_an_os_error_names_its_reason_and_file() -> None:
    assert describe(FileNotFoundError(2, "No such file or directory", "/etc/fedfleet/ca.pem")) == (
        "No such file or directory: /etc/fedfleet/ca.pem"
    )
    assert describe(OSError(98, "Address already in use")) == "Address already in use"


def test_a_broker_url_with_a_bad_port_is_refused_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--device", "d1", "--fleet", "f", "--broker", "mqtt://127.0.0.1:notaport"])

    assert code == 2
    err = capsys.readouterr().err
    assert "broker.url" in err and "the port must be a number from 1 to 65535" in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_is_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--device", "d1", "--fleet", "f", "--device-type", "cuda", "--state-dir", str(tmp_path)]

    assert main(args) == 1

    err = capsys.readouterr().err
    assert err.strip() == "device-agent: error: device 'cuda' requested but CUDA is not available on this machine"
