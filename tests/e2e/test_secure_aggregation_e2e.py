"""Secure aggregation end to end over TLS: ``coordinator start`` with its managed mosquitto (TLS, client
certificates, from provisioned kits) and five real ``device-agent`` processes, three FedAvg rounds under SecAgg+.

In round 2 one device is killed (SIGKILL) while it trains: after the key exchange (its pairwise masks are in the
other four's masked inputs) and before its own masked upload. The coordinator counts it out of the protocol at
once (its keys died with its process), rebuilds its mask key from its neighbours' shares, removes its masks and
closes the round on the other four. The device comes back as a new process on the same kit while round 2 is still
open (another device holds it open until then): it is not sent round 2's assignment again (it could not mask
it), and in round 3 it is a survivor like the others.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.config.fleet import load_fleet
from coordinator.run.rundir import read_metrics
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.coordinator.provision.kit_fixtures import provision_into
from tests.e2e.agent_held_in_round import HELD
from tests.paths import REPO_ROOT
from tests.processes import stop_processes, wait_for_text
from tests.waiting import until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto (the managed TLS broker) is not installed"),
]

DEVICES = ("d0", "d1", "d2", "d3", "d4")
VICTIM = "d3"
HOLDER = "d4"
"""Held in round 2's training until the victim is back, so that round 3 draws the new process."""


def fleet_yaml(port: int) -> str:
    devices = "".join(f"  - {{id: {d}, profile: x86-laptop-cpu}}\n" for d in DEVICES)
    return (
        "fleet: secagg-e2e\n"
        f"broker: {{mode: managed, host: 127.0.0.1, port: {port}, hosts: [localhost]}}\n"
        "model: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits, partition: iid}\n"
        "strategy: {name: fedavg}\nratios: [1]\n"
        "rounds: 3\nround_deadline_s: 300\nquorum: 0.75\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        # Screening reads single updates, which the coordinator never sees: off, as validation demands.
        "limits: {update_bound_factor: null, peer_min_cosine: null, peer_hard_floor: null}\n"
        "secure_aggregation: {threshold: 3, neighbours: 4}\n"
        f"devices:\n{devices}"
    )


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fedfleet-secagg-"))
    os.chmod(path, 0o711)  # mosquitto drops to its own user and must reach kits/broker
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_three_secure_rounds_over_tls_survive_a_device_killed_mid_protocol_that_comes_back(root: Path) -> None:
    fleet_file = root / "fleet.yaml"
    fleet_file.write_text(fleet_yaml(free_port()))
    fleet, _ = load_fleet(fleet_file)
    kits = provision_into(fleet, root)
    run_dir = root / "run"
    logs = {name: root / f"{name}.log" for name in ("coordinator", *DEVICES, "back")}
    release = root / "release-round-2"
    processes: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = logs[name].open("wb")
        # One compute thread each, as the other e2e agents run (--threads 1): six processes share the host's cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        processes[name] = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        return processes[name]

    coordinator = spawn(
        "coordinator",
        [
            *(sys.executable, "-m", "coordinator", "start", "--fleet", str(fleet_file), "--kits", str(kits.root)),
            *("--run-dir", str(run_dir), "--no-live", "--min-devices", str(len(DEVICES)), "--wait-timeout", "300"),
        ],
    )
    try:
        wait_for_text(logs["coordinator"], "broker: mqtts://", coordinator, timeout=60)
        for device in DEVICES:
            kit = str(kits.participant(device))
            if device == VICTIM:  # the real agent, held in its second training (round 2's) until killed
                spawn(device, [sys.executable, "-m", "tests.e2e.agent_held_in_round", kit, "2"])
            elif device == HOLDER:  # the real agent, held in round 2's training until `release` exists
                spawn(device, [sys.executable, "-m", "tests.e2e.agent_held_in_round", kit, "2", str(release)])
            else:
                spawn(device, [sys.executable, "-m", "device_agent", "run", "--kit", kit])

        wait_for_text(logs[VICTIM], HELD, processes[VICTIM], timeout=600)
        assert "round 2: training" in logs[VICTIM].read_text()  # its assignment: sent after round 2's key exchange
        wait_for_text(logs[HOLDER], HELD, processes[HOLDER], timeout=600)
        processes[VICTIM].send_signal(signal.SIGKILL)
        processes[VICTIM].wait()
        wait_for_text(logs["coordinator"], f"round 2: {VICTIM} left secure aggregation", coordinator, timeout=120)
        seen_online = logs["coordinator"].read_text().count(f"{VICTIM}: online (")

        # The device comes back: a new agent process on the same kit, while round 2 is still open.
        back = spawn("back", [sys.executable, "-m", "device_agent", "run", "--kit", str(kits.participant(VICTIM))])
        assert until(lambda: logs["coordinator"].read_text().count(f"{VICTIM}: online (") > seen_online, timeout=300), (
            logs["back"].read_text()[-4000:]
        )
        assert back.poll() is None
        release.touch()  # round 2 may close now; round 3 draws the device that came back

        coordinator.wait(timeout=900)
        output = logs["coordinator"].read_text()
        assert coordinator.returncode == 0, output[-4000:]
    finally:
        stop_processes(processes.values(), timeout=20)

    for device in set(DEVICES) - {VICTIM}:
        assert "connected to mqtts://localhost" in logs[device].read_text()
    rounds = read_metrics(run_dir / "metrics.jsonl")
    assert [r.round for r in rounds] == [1, 2, 3]
    statuses = [{d: m.status for d, m in r.devices.items()} for r in rounds]
    assert statuses[0] == dict.fromkeys(DEVICES, "accepted")
    others = dict.fromkeys(set(DEVICES) - {VICTIM}, "accepted")
    assert {d: s for d, s in statuses[1].items() if d != VICTIM} == others
    assert statuses[1][VICTIM] == "failed" and rounds[1].devices[VICTIM].reason == "secure_aggregation"
    assert statuses[2] == dict.fromkeys(DEVICES, "accepted")  # the device that came back is a survivor of round 3
    again = logs["back"].read_text()
    assert "round 2: training" not in again and "round 3: training" in again  # never round 2's: it could not mask it
    assert "plain update under secure_aggregation" not in output
    # Round 2's sum was unmasked with the killed device's masks removed (it had joined the key exchange).
    assert "round 1: secure sum of 5 updates (0 dropped)" in output
    assert "round 2: secure sum of 4 updates (1 dropped)" in output
    assert "round 3: secure sum of 5 updates (0 dropped)" in output
    secure = [r.secure for r in rounds]
    assert [(m.survivors, m.dropped) for m in secure if m is not None] == [(5, 0), (4, 1), (5, 0)]
    assert all(m is not None and m.clamped_fraction < 2e-5 for m in secure)  # none clamped (to 1.5e-5, a half step)
    assert rounds[-1].accuracy is not None and rounds[-1].accuracy > 0.5
    # No device's update was stored: nothing journaled, no plain update payload counted.
    journal = run_dir / "journal"
    assert not journal.exists() or not any(path.is_file() for path in journal.rglob("*"))
    print("round seconds:", [round(r.seconds, 1) for r in rounds])
