"""``recorder``, a port kind from another package: a coordinator that only listens, for the tests of port kinds.

Its port writes what the agent says to a file in the agent's state folder (its one setting, ``transport.record``,
default ``heard.jsonl``) (and its preflight to
``preflight.json``) and, once it has heard the agent's hello, calls the module's ``after_hello``: by default it
stops the agent's process as Ctrl-C would, which is how ``device-agent run`` ends under test; a test that hosts the
agent in its own process replaces it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from device_agent.agent.ports import PORTS
from tests.plugins import installed_plugin

PLUGIN = '''
"""The recorder port kind: the agent's coordinator is a file that records what the agent says."""

import json
import os
import signal
from pathlib import Path

from device_agent.agent.ports import PORTS, PortKind
from device_agent.wire.messages import Hello


def after_hello():
    """Stop this agent's process the way Ctrl-C does (device-agent run's signal handler)."""
    os.kill(os.getpid(), signal.SIGTERM)


class RecorderPort:
    def __init__(self, config):
        self.file = Path(config.state_dir) / config.transport.model_extra.get("record", "heard.jsonl")
        self.where = f"a recording in {self.file}"
        self.connects = 0

    def _write(self, entry):
        with self.file.open("a") as out:
            out.write(json.dumps(entry) + "\\n")

    def start(self, on_message, on_payload, timeout=None):
        self.connects = 1

    def stop(self):
        self._write({"stopped": True})

    def publish(self, message, retain=False):
        self._write(message.model_dump(mode="json"))
        if isinstance(message, Hello):
            after_hello()

    def send(self, payload, sign=None, **fields):
        raise AssertionError("nothing was assigned, so nothing is uploaded")

    def cancel(self, transfer):
        pass

    def fatal(self):
        return None


class Recorder(PortKind):
    def problems(self, config):
        settings = dict(config.transport.model_extra)
        record = settings.pop("record", "heard.jsonl")
        wrong = [f"transport.{key}: not a setting of port kind 'recorder' (it takes record)" for key in settings]
        if not isinstance(record, str):
            wrong.append(f"transport.record: a file name in the state folder, got {record!r}")
        return wrong

    def port(self, config, before_chunk_out=None, after_chunk_in=None):
        return RecorderPort(config)

    def preflight(self, config, give_up_s):
        Path(config.state_dir, "preflight.json").write_text(json.dumps({"give_up_s": give_up_s}))


PORTS.register("recorder", Recorder())
'''


@contextmanager
def recorder_installed(folder: Path) -> Iterator[Path]:
    """Install the one-module plugin in ``folder`` with a real entry point; ``folder`` is what a subprocess's
    PYTHONPATH needs too."""
    folder.mkdir(parents=True, exist_ok=True)
    entry_points = {"fedfleet.ports": {"recorder": "recorder_port"}}
    with installed_plugin(folder, "recorder-port", entry_points, {"recorder_port": PLUGIN}):
        PORTS.reload()
        try:
            yield folder
        finally:
            PORTS.unregister("recorder")


def agent_yaml(folder: Path, kind: str = "recorder", device: str = "dev-a", **settings: object) -> Path:
    """``folder/agent.yaml`` for ``device`` of fleet lab on port kind ``kind`` with its ``settings``, its state in
    ``folder/state``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "agent.yaml"
    transport = {"kind": kind, **settings}
    path.write_text(yaml.safe_dump({"device": device, "fleet": "lab", "transport": transport, "state_dir": "state"}))
    return path


def heard(state: Path, record: str = "heard.jsonl") -> list[dict]:
    """What the recorder's port heard, in order (``{"stopped": true}`` last once the agent has stopped)."""
    return [json.loads(line) for line in (state / record).read_text().splitlines()]
