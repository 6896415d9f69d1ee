"""Many devices uploading at once to one coordinator, against raw paho doing the same bytes.

Each device is its own process (as on a real fleet, no GIL shared with the coordinator) holding a
device session and a plain paho client on the same mosquitto. On each signal every device uploads
its update at once, in one of four ways:

- ``raw``: plain paho publishes the same bytes as the same chunks at QoS 1 to a plain paho
  subscriber; the clock stops when that subscriber has every chunk of every device. These clients
  log in as the coordinator, whose ACL covers topics outside the devices' subtrees;
- ``fedfleet``: the device's ``Session.send`` with a sealed manifest made beforehand
  (``make_manifest``, as for an update hashed when it was stored), so the window holds the
  coordinator's ingest and no sender-side hashing; the clock stops when the coordinator session's
  payload handler holds every device's joined, verified bytes;
- ``fedfleet_hashing``: the same, with each device hashing its chunks as it sends them (what
  ``Session.send`` does without a manifest);
- ``raw_hashing``: ``raw`` whose subscriber takes the sha256 of every chunk as it arrives: the
  ceiling of any receiver that checks every byte, so ``hash_bound_ratio`` (raw_hashing / raw) says
  how much of the gap to raw the digest alone costs on this machine.

The coordinator process keeps freed buffers for reuse, as ``coordinator start`` does
(``coordinator.transport.allocator``); the raw subscriber lives in that process too.

Each repeat runs the three back to back; ratios are the medians of the per-repeat ratios, so load
from other jobs on a shared machine hits both sides of a ratio alike.

The CPU seconds of every process taking part (the receiving process, the device processes, the broker)
are counted per variant. Where mosquitto, the senders and the receiver saturate the cores, throughput
follows the whole machine's CPU per byte, not the receiver's alone: ``cpu_vs_hash_bound`` and
``receiver_cpu_vs_hash_bound`` say which side the gap to ``raw_hashing`` comes from.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from coordinator.transport.allocator import keep_freed_buffers
from coordinator.transport.broker.base import BrokerProcess, BrokerSettings
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.factory import make_broker
from device_agent.wire.session import BrokerAddress, coordinator_session, device_session
from device_agent.wire.topics import ROOT
from device_agent.wire.transfer import Completed, make_manifest

_FLEET = "fanin"
_MAX_INFLIGHT = 100
_TIMEOUT_S = 300.0
_RAW_SUBSCRIBER = "raw-subscriber"
VARIANTS = ("raw", "raw_hashing", "fedfleet", "fedfleet_hashing")


def raw_client(address: BrokerAddress, client_id: str, v5: bool = True) -> mqtt.Client:
    """A plain paho client (the baseline), tuned as fedfleet's sessions are: in-flight window, no Nagle."""
    protocol = MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol)
    client.username_pw_set(address.username, address.password)
    client.max_inflight_messages_set(_MAX_INFLIGHT)
    client.connect(address.host, address.port)
    client.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.loop_start()
    return client


def _raw_topic(device: str) -> str:
    """Outside every device's ``up`` subtree, which the coordinator session subscribes to."""
    return f"{ROOT}/{_FLEET}/raw/{device}"


def _device(
    address: BrokerAddress, raw_address: BrokerAddress, device: str, size: int, chunk_size: int, orders: Connection
) -> None:
    """One device process: waits for an order (one of ``VARIANTS``), uploads, reports back."""
    payload = os.urandom(size)
    view = memoryview(payload)
    session, topics = device_session(_FLEET, device, address, chunk_size=chunk_size, max_inflight=_MAX_INFLIGHT)
    session.start()
    sealed = make_manifest(payload, chunk_size, run="fan-in", kind="update")
    raw = raw_client(raw_address, f"raw-{device}")
    try:
        orders.send("ready")
        while (order := orders.recv()) is not None:
            if order.startswith("raw"):
                # Each chunk cut out of the payload as it is sent (one copy), as fedfleet frames it (one copy).
                parts = (bytes(view[i : i + chunk_size]) for i in range(0, size, chunk_size))
                infos = [raw.publish(_raw_topic(device), part, qos=1) for part in parts]
                for info in infos:
                    info.wait_for_publish(_TIMEOUT_S)
            elif order == "fedfleet":
                session.send(topics.up, payload, manifest=sealed).wait(_TIMEOUT_S)
            else:
                session.send(topics.up, payload, run="fan-in", kind="update").wait(_TIMEOUT_S)
            orders.send("done")
    finally:
        raw.disconnect()
        raw.loop_stop()
        session.stop()


class _Arrivals:
    """Counts what the coordinator side has received, and says when a whole round is in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = 0
        self.bytes = 0
        self.finished = threading.Event()

    def expect(self, count: int) -> None:
        with self._lock:
            self._left, self.bytes = count, 0
            self.finished.clear()

    def arrived(self, size: int) -> None:
        with self._lock:
            self._left -= 1
            self.bytes += size
            if self._left == 0:
                self.finished.set()


def measure(devices: int, size: int, chunk_size: int, repeats: int, workdir: Path) -> dict[str, float | None]:
    """MB/s into the coordinator side per variant (medians) and the ratios of each to ``raw``.

    ``ratio``, ``hashing_ratio`` and ``hash_bound_ratio``: fedfleet, fedfleet_hashing and raw_hashing
    to raw; ``vs_hash_bound``: fedfleet to raw_hashing; the CPU keys of ``_cpu_ratios``.
    """
    names = [f"dev{i}" for i in range(devices)]
    # The raw baseline has logins of its own: the broker binds a client id to its login, so a raw client
    # sharing the coordinator's or a device's login would take over (disconnect) that session.
    creds = generate_credentials([*names, *(f"raw-{n}" for n in names), _RAW_SUBSCRIBER])
    raw_acl = [line for n in names for line in (f"user raw-{n}", f"topic write {_raw_topic(n)}")]
    raw_acl += [f"user {_RAW_SUBSCRIBER}", f"topic read {_raw_topic('#')}"]
    settings = BrokerSettings(_FLEET, workdir / "fan-in", creds, extra_acl=raw_acl)
    broker = make_broker(settings, prefer="mosquitto")
    broker.start()
    chunks = -(-size // chunk_size)
    raw_in, ours_in = _Arrivals(), _Arrivals()
    hash_raw = threading.Event()
    keep_freed_buffers()

    def on_raw(_client: mqtt.Client, _userdata: object, msg: mqtt.MQTTMessage) -> None:
        if hash_raw.is_set():
            hashlib.sha256(msg.payload).digest()
        raw_in.arrived(len(msg.payload))

    def on_payload(_topic: str, completed: Completed) -> None:
        ours_in.arrived(len(completed.data))  # the join the engine does, on the same thread

    coordinator = coordinator_session(_FLEET, broker.address, on_payload=on_payload, max_inflight=_MAX_INFLIGHT)
    subscribed = threading.Event()
    raw_sub = raw_client(broker.address_for(creds[_RAW_SUBSCRIBER]), _RAW_SUBSCRIBER)
    raw_sub.on_message = on_raw
    raw_sub.on_subscribe = lambda *_a: subscribed.set()
    raw_sub.subscribe(_raw_topic("+"), qos=1)
    spawn = multiprocessing.get_context("spawn")
    links = [spawn.Pipe() for _ in names]
    logins = [(broker.address_for(creds[name]), broker.address_for(creds[f"raw-{name}"])) for name in names]
    workers = [
        spawn.Process(target=_device, args=(login, raw_login, name, size, chunk_size, child), daemon=True)
        for name, (login, raw_login), (_parent, child) in zip(names, logins, links, strict=True)
    ]
    started: list[multiprocessing.process.BaseProcess] = []
    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    sides: dict[str, list[psutil.Process]] = {"receiver": [psutil.Process()], "devices": [], "broker": []}
    cpu = {variant: dict.fromkeys(("receiver", "devices", "broker"), 0.0) for variant in VARIANTS}
    try:
        coordinator.start()
        for worker in workers:
            worker.start()
            started.append(worker)
        for parent, _child in links:
            _expect(parent, "ready")
        if not subscribed.wait(10):
            raise RuntimeError("raw subscriber never subscribed")
        sides["devices"] = [psutil.Process(worker.pid) for worker in started]
        if isinstance(broker, BrokerProcess) and broker.process is not None:
            sides["broker"] = [psutil.Process(broker.process.pid)]
        for _ in range(repeats):
            for variant in VARIANTS:
                raw = variant.startswith("raw")
                arrivals, count = (raw_in, devices * chunks) if raw else (ours_in, devices)
                arrivals.expect(count)
                if variant == "raw_hashing":
                    hash_raw.set()
                else:
                    hash_raw.clear()
                used = {side: _cpu_seconds(processes) for side, processes in sides.items()}
                start = time.perf_counter()
                for parent, _child in links:
                    parent.send(variant)
                if not arrivals.finished.wait(_TIMEOUT_S):
                    raise RuntimeError(f"{variant} fan-in incomplete after {_TIMEOUT_S:.0f} s")
                seconds[variant].append(time.perf_counter() - start)
                for side, processes in sides.items():
                    cpu[variant][side] += (_cpu_seconds(processes) - used[side]) / repeats
                if arrivals.bytes != devices * size:
                    raise RuntimeError(f"{variant} fan-in delivered {arrivals.bytes} bytes, expected {devices * size}")
                for parent, _child in links:
                    _expect(parent, "done")
    finally:
        for worker, (parent, _child) in zip(workers, links, strict=True):
            if worker in started:
                parent.send(None)
        for worker in started:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
        raw_sub.disconnect()
        raw_sub.loop_stop()
        coordinator.stop()
        broker.stop()
    result = {
        f"{variant}_mbps": devices * size / statistics.median(values) / 1e6 for variant, values in seconds.items()
    }
    pairs = {
        "ratio": ("raw", "fedfleet"),
        "hashing_ratio": ("raw", "fedfleet_hashing"),
        "hash_bound_ratio": ("raw", "raw_hashing"),
        "vs_hash_bound": ("raw_hashing", "fedfleet"),
    }
    for key, (base, other) in pairs.items():
        result[key] = statistics.median(b / o for b, o in zip(seconds[base], seconds[other], strict=True))
    return result | _cpu_ratios(cpu)


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    """User and system CPU seconds ``processes`` have used so far."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def _cpu_ratios(cpu: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """Milliseconds of CPU per repeat for each variant and side, and fedfleet's CPU against the hash bound's."""
    result = {
        f"{variant}_{side}_cpu_ms": seconds * 1000 for variant, sides in cpu.items() for side, seconds in sides.items()
    }
    bound, ours = cpu["raw_hashing"], cpu["fedfleet"]
    # CPU times come in 10 ms clock ticks: a run too short to register any says None, not a ratio.
    result["cpu_vs_hash_bound"] = _ratio(sum(bound.values()), sum(ours.values()))
    result["receiver_cpu_vs_hash_bound"] = _ratio(bound["receiver"], ours["receiver"])
    return result


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if numerator > 0 and denominator > 0 else None


def _expect(link: Connection, word: str) -> None:
    if not link.poll(_TIMEOUT_S):
        raise RuntimeError(f"a device process sent nothing for {_TIMEOUT_S:.0f} s (expected {word!r})")
    got = link.recv()
    if got != word:
        raise RuntimeError(f"a device process answered {got!r}, expected {word!r}")
