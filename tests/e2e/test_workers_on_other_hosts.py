"""Workers on other hosts reach the coordinator's managed TLS broker over a real interface.

Two network namespaces stand in for two worker machines ("host-a", "host-b"), each joined to this host
by a veth pair of its own and routed only through it. The coordinator and its managed mosquitto run
here, the broker listening on host-a's veth address (the one in ``broker.hosts``, so in the server
certificate), never on loopback; host-b reaches it across a second subnet. Each worker host runs
``device-agent emulate`` for two of the four devices with the devices' provisioned kits (password,
CA, client certificate). Needs root and ``ip netns``; everything made is removed, failure included.

    sudo env PYTHONPATH=$PWD .venv/bin/python -m pytest -s tests/e2e/test_workers_on_other_hosts.py
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.netns import Namespace, netns_problem, run
from coordinator.run.rundir import read_metrics
from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.paths import REPO_ROOT

BROKER_IP = "10.214.0.1"
# host: (profile, first index, this side of its veth, its side); the broker listens on host-a's link only
HOSTS = {
    "host-a": ("raspberry-pi-5", 0, BROKER_IP, "10.214.0.2"),
    "host-b": ("x86-laptop-cpu", 2, "10.215.0.1", "10.215.0.2"),
}
PER_HOST, ROUNDS, FLEET, PREFIX = 2, 2, "hosts-e2e", "edge"
TIMEOUT = 420.0

_problem = netns_problem()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_problem is not None, reason=f"needs network namespaces: {_problem}"),
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto (the managed TLS broker) is not installed"),
]


def _devices(host: str) -> list[str]:
    first = HOSTS[host][1]
    return [f"{PREFIX}-{i:02d}" for i in range(first, first + PER_HOST)]


def _fleet_yaml(port: int) -> str:
    devices = "".join(f"  - {{id: {d}, profile: {HOSTS[h][0]}}}\n" for h in HOSTS for d in _devices(h))
    return (
        f"fleet: {FLEET}\n"
        f"broker: {{mode: managed, host: {BROKER_IP}, port: {port}, hosts: [{BROKER_IP}]}}\n"
        "model: {arch: cnn, num_classes: 10}\n"
        "dataset: {name: digits, partition: iid}\n"
        f"ratios: [1, 1/2]\nrounds: {ROUNDS}\nround_deadline_s: 300\nquorum: 1.0\n"
        "training: {batch_size: 32, local_epochs: 1, lr: 0.05}\n"
        f"devices:\n{devices}"
    )


@pytest.fixture
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fedfleet-hosts-"))
    os.chmod(path, 0o711)  # mosquitto drops to its own user and must reach kits/broker
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _spawn(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _stop(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.terminate()  # emulate stops its agents on SIGTERM; the coordinator its broker
    for process in processes.values():
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _emulate(host: str, ns: Namespace, work: Path, port: int) -> list[str]:
    profile, first, _, _ = HOSTS[host]
    kit = work / "kits" / "{device}"
    return [
        *ns.prefix(),
        *(sys.executable, "-m", "device_agent", "emulate", "--profile", profile, "--count", str(PER_HOST)),
        *("--first-index", str(first), "--total", str(PER_HOST * len(HOSTS)), "--prefix", PREFIX),
        *("--broker", f"mqtts://{BROKER_IP}:{port}", "--fleet", FLEET),
        *("--ca-file", str(work / "kits" / _devices(host)[0] / "ca.pem"), "--password", f"file:{kit}/password"),
        *("--cert-file", f"{kit}/client.pem", "--key-file", f"{kit}/client.key"),
        *("--host-gflops", "100", "--run-dir", str(work / host)),  # fixed: no GFLOPS probe on a busy host
    ]


def _veth_bytes(ns: Namespace) -> tuple[int, int]:
    """Bytes this host received from and sent to the namespace over its veth (uploads, downloads)."""
    stats = Path("/sys/class/net") / ns.host_if / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def test_two_worker_hosts_train_with_the_broker_over_veths(work: Path) -> None:
    port = free_port()
    fleet, run_dir, coordinator_log = work / "fleet.yaml", work / "run", work / "coordinator.log"
    fleet.write_text(_fleet_yaml(port))
    coordinator = [sys.executable, "-m", "coordinator"]
    run([*coordinator, "provision", "--fleet", str(fleet), "--out", str(work / "kits")], cwd=REPO_ROOT)
    processes: dict[str, subprocess.Popen[bytes]] = {}
    with contextlib.ExitStack() as stack:
        spaces = {
            host: stack.enter_context(Namespace(f"fedfleet-{host}", f"ff{host[-1]}", here, there, gateway=True))
            for host, (_, _, here, there) in HOSTS.items()
        }
        stack.callback(_stop, processes)  # runs first: processes end before their namespaces go
        processes["coordinator"] = _spawn(
            [
                *coordinator,
                *("start", "--fleet", str(fleet), "--kits", str(work / "kits"), "--run-dir", str(run_dir)),
                *("--no-live", "--min-devices", str(PER_HOST * len(HOSTS)), "--wait-timeout", "300"),
            ],
            coordinator_log,
        )
        deadline = time.monotonic() + 60
        while f"mqtts://{BROKER_IP}:{port}" not in coordinator_log.read_text():
            assert processes["coordinator"].poll() is None, coordinator_log.read_text()
            assert time.monotonic() < deadline, f"no broker after 60 s:\n{coordinator_log.read_text()}"
            time.sleep(0.2)
        before = {host: _veth_bytes(ns) for host, ns in spaces.items()}
        started = time.monotonic()
        for host, ns in spaces.items():
            processes[host] = _spawn(_emulate(host, ns, work, port), work / f"{host}.log")
        deadline = time.monotonic() + TIMEOUT
        while processes["coordinator"].poll() is None:
            for host in spaces:
                assert processes[host].poll() is None, (work / f"{host}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, coordinator_log.read_text()[-3000:]
            time.sleep(1)
        wall = time.monotonic() - started
        after = {host: _veth_bytes(ns) for host, ns in spaces.items()}
        names = [ns.name for ns in spaces.values()]
    assert processes["coordinator"].returncode == 0, coordinator_log.read_text()[-3000:]
    assert all(processes[host].returncode == 0 for host in HOSTS), {h: processes[h].returncode for h in HOSTS}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed  # cleaned up

    rounds = read_metrics(run_dir / "metrics.jsonl")
    assert [r.round for r in rounds] == list(range(1, ROUNDS + 1))
    print(f"\n{ROUNDS} rounds over veths, {wall:.1f} s from the workers' start to the coordinator's exit")
    print("round seconds:", [round(r.seconds, 1) for r in rounds], "accuracy:", [r.accuracy for r in rounds])
    for host, (profile, _, _, _) in HOSTS.items():
        records = [r.devices[d] for r in rounds for d in _devices(host)]
        assert all(d.status == "accepted" for d in records), [(d.status, d.error) for d in records]
        up = sum(d.bytes_up for d in records)
        down = sum(d.bytes_down for d in records)
        rx, tx = (a - b for a, b in zip(after[host], before[host], strict=True))
        # the updates crossed this host's veth: what the wire carried is at least what the protocol counted
        assert rx >= up and tx >= down, (host, rx, up, tx, down)
        train = [round(d.train_seconds or 0.0, 1) for d in records]
        print(
            f"{host} ({PER_HOST} x {profile}): {len(records)}/{len(records)} updates accepted, train s {train}, "
            f"protocol up {up / 1e6:.2f} MB down {down / 1e6:.2f} MB, veth rx {rx / 1e6:.2f} MB tx {tx / 1e6:.2f} MB"
        )
