"""Signed uploads end to end over real mosquitto: a real coordinator, two real signing agents, and a forger.

The forger holds d1's broker password (stolen, or a second client on a shared login), so the broker
lets it publish on d1's topics; only the signature tells its uploads from d1's. It sends while
round 1 is open (both agents train ten times slower): one signed with the wrong key, one genuine
signature sent again under another transfer id (a replay), one unsigned.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from coordinator.config.fleet import load_fleet
from coordinator.provision import provision
from coordinator.provision.layout import SIGNING_KEY
from coordinator.transport.broker.base import BrokerSettings, free_port
from coordinator.transport.broker.credentials import COORDINATOR_USER, Credentials, generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from device_agent.agent.signing import UploadIdentity, signed_meta
from device_agent.wire.messages import Error, Message
from device_agent.wire.session import Session, SessionConfig
from device_agent.wire.topics import DeviceTopics
from device_agent.wire.transfer import make_manifest, new_transfer_id
from tests.paths import REPO_ROOT
from tests.processes import stop_processes

pytestmark = pytest.mark.slow

FLEET = "signed"
DEVICES = ("d0", "d1")
ROOT = REPO_ROOT


def _forge(broker: MosquittoBroker, login: Credentials, run: str, key: bytes) -> dict[str, Error]:
    """Three forged uploads as d1; the coordinator's Error answer to each, by what was forged."""
    topics = DeviceTopics(FLEET, "d1")
    answers: list[Message] = []
    session = Session(
        SessionConfig(client_id="forger-d1", broker=broker.address_for(login)),
        subscriptions=[topics.down],
        on_message=lambda _t, m: answers.append(m),
    )
    payload = b"forged update bytes" * 50
    digest = make_manifest(payload, session.config.chunk_size).digest  # what the transfer will seal
    meta = {"samples": "10", "train_seconds": "1", "loss": "1"}
    sent: dict[str, str] = {}
    with session.start():
        for forgery in ("wrong_key", "replayed", "unsigned"):
            transfer = new_transfer_id()
            signed_for = new_transfer_id() if forgery == "replayed" else transfer
            signing_key = secrets.token_bytes(32) if forgery == "wrong_key" else key
            identity = UploadIdentity(FLEET, run, 1, "d1", signed_for, digest)  # type: ignore[arg-type]
            forged = meta if forgery == "unsigned" else signed_meta(meta, signing_key, identity)
            session.send(topics.up, payload, run=run, round=1, kind="update", meta=forged, transfer=transfer)
            sent[transfer] = forgery
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len({a.transfer for a in answers if isinstance(a, Error)}) < 3:
            time.sleep(0.1)
    return {sent[a.transfer]: a for a in answers if isinstance(a, Error) and a.transfer in sent}


def test_a_signing_fleet_accepts_its_devices_and_refuses_a_forger(tmp_path: Path) -> None:
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="fedfleet-signed-"))
    os.chmod(workdir, 0o711)
    credentials = generate_credentials(DEVICES)
    port = free_port()
    broker = MosquittoBroker(BrokerSettings(FLEET, workdir, credentials, port=port))
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    for name, cred in credentials.items():
        (secrets_dir / name).write_text(cred.password)
    # Compute pinned to what --slowdown 10 makes of a laptop: planning from what the agents probe on a
    # loaded machine could put a device past the deadline, and the round would open without it.
    devices = "".join(
        f"  - {{id: {d}, profile: x86-laptop-cpu, credentials: 'file:{secrets_dir / d}', "
        "overrides: {compute: {fp32_gflops: 0.8, memory_bandwidth_gbs: 0.3}}}\n"
        for d in DEVICES
    )
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(
        f"fleet: {FLEET}\nbroker: {{mode: external, url: 'mqtt://127.0.0.1:{port}', "
        f"password: 'file:{secrets_dir / COORDINATOR_USER}'}}\n"
        "security: {sign_uploads: true}\n"
        "model: {arch: cnn, num_classes: 10}\ndataset: {name: digits, partition: iid}\n"
        "ratios: [1]\nrounds: 1\nround_deadline_s: 60\nquorum: 0.5\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        f"devices:\n{devices}"
    )
    kits = provision(load_fleet(fleet_file)[0], tmp_path / "kits").kits
    run_dir = tmp_path / "run"
    processes: list[subprocess.Popen] = []

    def spawn(command: list[str], log: str) -> subprocess.Popen:
        out = (tmp_path / log).open("ab")
        processes.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        return processes[-1]

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(tmp_path.glob("*.log")))

    broker.start()
    try:
        start = [sys.executable, "-m", "coordinator", "start", "--fleet", str(fleet_file), "--kits", str(kits.root)]
        start += ["--run-dir", str(run_dir), "--no-live", "--min-devices", "2", "--wait-timeout", "60"]
        coordinator = spawn(start, "coordinator.log")
        for index, device in enumerate(DEVICES):
            command = [sys.executable, "-m", "device_agent", "run", "--device", device, "--fleet", FLEET]
            command += ["--broker", f"mqtt://127.0.0.1:{port}", "--password", f"file:{secrets_dir / device}"]
            command += ["--signing-key", f"file:{kits.participant(device) / SIGNING_KEY}"]
            command += ["--index", str(index), "--count", "2", "--threads", "1", "--slowdown", "10"]
            spawn([*command, "--state-dir", str(tmp_path / "agents" / device)], f"{device}.log")
        open_round = run_dir / "open-round.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not open_round.exists():
            time.sleep(0.2)
        assert open_round.exists(), f"round 1 never opened\n{logs()}"
        participants = json.loads(open_round.read_text())["participants"]
        assert set(DEVICES) <= set(participants), f"round 1 opened without both devices\n{logs()}"
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        key = bytes.fromhex((kits.participant("d1") / SIGNING_KEY).read_text())
        refused = _forge(broker, credentials["d1"], run_id, key)

        coordinator.wait(timeout=90)
        assert coordinator.returncode == 0, logs()
    finally:
        stop_processes(processes, timeout=15)
        broker.stop()

    assert "does not verify with d1's key" in refused["wrong_key"].detail, logs()
    assert "signed for round 1 transfer" in refused["replayed"].detail
    assert "is not signed" in refused["unsigned"].detail
    assert all(error.code == "rejected" for error in refused.values())
    (round_1,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert round_1["devices"].get("d0", {}).get("status") == "accepted", round_1
    journal = (run_dir / "journal").glob("round-*/index.jsonl")
    assert all("forged" not in path.read_text() for path in journal)
