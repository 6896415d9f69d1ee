"""A fleet over the second transport, WebSockets over TLS: real processes, as an operator runs them.

``coordinator provision`` makes the kits (the fleet's CA, the server certificate, one client certificate and
password per device, each agent.yaml saying ``transport: {kind: websocket, url: wss://...}``); three
``device-agent run --kit`` processes and one ``coordinator start`` run four rounds of signed uploads; no
broker runs. As round 2
starts, one agent is killed (SIGKILL: no goodbye; its closed connection is its ``offline``) and a new process
is started on the same kit and state dir. Round 2 is held open meanwhile (another agent is paused with
SIGSTOP, so the round cannot close without it): the new process is sent round 2's assignment again, trains it,
and is accepted in the very round its predecessor was killed in; the run completes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.transport.broker.base import free_port
from tests.processes import stop_processes, wait_for_text

pytestmark = pytest.mark.slow

DEVICES = ("ws-a", "ws-b", "ws-c")
KILLED = "ws-c"
HELD = "ws-a"
ROUNDS = 4


def fleet_yaml(port: int) -> str:
    devices = "".join(f"  - {{id: {d}, profile: x86-laptop-cpu}}\n" for d in DEVICES)
    return (
        "fleet: wsfleet\n"
        f"transport: {{kind: websocket, host: 127.0.0.1, port: {port}, keepalive_s: 120}}\n"
        "model: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits, partition: iid}\n"
        f"rounds: {ROUNDS}\nround_deadline_s: 200\nquorum: 1.0\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        "security: {sign_uploads: true}\n"
        f"devices:\n{devices}"
    )


def test_a_fleet_over_websockets_with_tls_survives_a_killed_agent(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(fleet_yaml(free_port()))
    provisioned = subprocess.run(
        [sys.executable, "-m", "coordinator", "provision", "--fleet", "fleet.yaml", "--out", "kits"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert provisioned.returncode == 0, provisioned.stderr
    kit = (tmp_path / "kits" / KILLED / "agent.yaml").read_text()
    assert "kind: websocket" in kit and "url: wss://127.0.0.1:" in kit and "cert_file:" in kit

    processes: list[subprocess.Popen] = []

    def spawn(name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=tmp_path, stdout=log.open("ab"), stderr=subprocess.STDOUT
        )
        processes.append(process)
        return process, log

    def agent(device: str) -> tuple[subprocess.Popen, Path]:
        return spawn(device, "device_agent", "run", "--kit", f"kits/{device}", "--threads", "1")

    def journaled(round_: int) -> set[str]:
        path = tmp_path / "run" / "journal" / f"round-{round_:06d}" / "index.jsonl"
        return {json.loads(line)["device"] for line in path.read_text().splitlines()} if path.exists() else set()

    started = time.monotonic()
    try:
        agents = {device: agent(device) for device in DEVICES}
        coordinator, coordinator_log = spawn(
            "coordinator", "coordinator", "start", "--fleet", "fleet.yaml", "--kits", "kits", "--run-dir", "run",
            "--no-live", "--min-devices", str(len(DEVICES)), "--wait-timeout", "120",
        )  # fmt: skip
        wait_for_text(coordinator_log, "round 2: ", coordinator, timeout=240)
        held = agents[HELD][0]
        held.send_signal(signal.SIGSTOP)  # round 2 cannot close while HELD is online and has not answered
        victim, victim_log = agents[KILLED]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert f"{KILLED}: round 2 trained" not in victim_log.read_text(), "killed too late: round 2 was done"
        restarted, _ = agent(KILLED)  # the same kit and state dir: a device that rebooted
        deadline = time.monotonic() + 240
        while KILLED not in journaled(2):
            assert restarted.poll() is None and coordinator.poll() is None, coordinator_log.read_text()[-4000:]
            assert time.monotonic() < deadline, victim_log.read_text()[-4000:]
            time.sleep(0.2)
        held.send_signal(signal.SIGCONT)
        coordinator.wait(timeout=300)
        wall = time.monotonic() - started
        text = coordinator_log.read_text()
        assert coordinator.returncode == 0, text[-4000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        stop_processes(processes)

    assert "websocket: wss://127.0.0.1:" in text and "all rounds done" in text and "FAILED" not in text
    rounds = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == list(range(1, ROUNDS + 1))
    assert all(r["devices"][d]["status"] == "accepted" for r in rounds for d in DEVICES), rounds
    assert f"{KILLED}: offline" in text  # its closed connection, said by the server (MQTT's last will)
    again = victim_log.read_text()
    assert again.count(f"{KILLED}: connected to wss://127.0.0.1:") == 2, again[-3000:]
    assert f"{KILLED}: round 2 trained" in again
    assert rounds[-1]["accuracy"] > 0.8
    overheads = [row["bytes_up"] / row["payload_bytes"] for r in rounds for row in r["devices"].values()]
    assert min(overheads) > 1.0 and sorted(overheads)[len(overheads) // 2] < 1.05, overheads  # headers, manifests
    print(f"{ROUNDS} rounds over websockets, {KILLED} killed in round 2 and back in it: {wall:.1f} s")
