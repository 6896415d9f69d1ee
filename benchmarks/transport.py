"""Verified chunked transfers against the best the broker can do, side by side in one run.

For each broker (a managed mosquitto, the amqtt fallback) and a payload of ``--size-mib``:

- ``raw_chunks``: plain paho publishes the same bytes as the same number of chunks at QoS 1 to a
  plain paho subscriber, no protocol of ours: the broker's ceiling for this traffic;
- ``fedfleet``: ``Session.send`` to a device session, from the bytes in hand (hashing on both sides
  included) to the sender holding the receiver's ack of the complete, verified payload;
- ``fedfleet_in_handler``: the same transfers, until the device's payload handler holds the joined
  bytes (the receiver joins the verified chunks on its dispatcher thread, after acking);
- ``raw_single`` (mosquitto): one raw publish of the whole payload.

Then the fan-in (``benchmarks.fan_in``): ``--devices`` device processes each upload ``--fan-in-mib``
at once to one coordinator session, against raw paho doing the same: ``fan_in_ratio`` with the
devices' chunks hashed beforehand, ``fan_in_hashing_ratio`` with them hashed while sending.

Runs alternate and medians are reported, so machine load hits all variants alike.

    python -m benchmarks.transport --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from benchmarks import fan_in
from coordinator.transport.broker.base import BrokerSettings
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.factory import make_broker
from device_agent.wire.session import BrokerAddress, coordinator_session, device_session
from device_agent.wire.topics import DeviceTopics
from device_agent.wire.transfer import DEFAULT_CHUNK_SIZE, Completed, Limits

_FLEET = "bench"
_MAX_INFLIGHT = 100


def raw_seconds(sender: BrokerAddress, receiver: BrokerAddress, topic: str, parts: list[bytes], v5: bool) -> float:
    """Seconds from the first publish until the subscriber has every part (QoS 1 both ways)."""
    remaining = [len(parts)]
    subscribed, finished = threading.Event(), threading.Event()

    def on_message(_c: mqtt.Client, _u: object, _m: mqtt.MQTTMessage) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            finished.set()

    sub = fan_in.raw_client(receiver, "bench-raw-sub", v5)
    sub.on_message = on_message
    sub.on_subscribe = lambda *_a: subscribed.set()
    sub.subscribe(topic, qos=1)
    pub = fan_in.raw_client(sender, "bench-raw-pub", v5)
    try:
        if not subscribed.wait(10):
            raise RuntimeError("raw subscriber never subscribed")
        start = time.perf_counter()
        for part in parts:
            pub.publish(topic, part, qos=1)
        if not finished.wait(300):
            raise RuntimeError(f"raw transfer incomplete: {remaining[0]} of {len(parts)} parts missing")
        return time.perf_counter() - start
    finally:
        for client in (pub, sub):
            client.disconnect()
            client.loop_stop()


def measure_broker(kind: str, payload: bytes, chunk_size: int, repeats: int, workdir: Path) -> dict[str, float]:
    v5 = kind == "mosquitto"
    protocol = "5" if v5 else "3.1.1"
    topics = DeviceTopics(_FLEET, "dev")
    # Raw runs use a topic of the fleet that no session subscribes to.
    raw_topic = f"{topics.base}/down/raw"
    # mosquitto binds a client id to its login, so the raw clients get logins of their own there (one
    # sharing a session's login would take its connection over); amqtt binds nothing and knows no such ACL,
    # so both raw clients log in as the coordinator there (a device may read only its down/data).
    raw_users = ["raw-pub", "raw-sub"] if v5 else []
    creds = generate_credentials(["dev", *raw_users])
    raw_acl = ["user raw-pub", f"topic write {raw_topic}", "user raw-sub", f"topic read {raw_topic}"] if v5 else []
    # Room for one unchunked publish of the whole payload (the raw_single comparison).
    settings = BrokerSettings(
        _FLEET, workdir / kind, creds, max_packet_bytes=len(payload) + (1 << 20), extra_acl=raw_acl
    )
    broker = make_broker(settings, prefer=kind)
    broker.start()
    coordinator_addr, device_addr = broker.address, broker.address_for(creds["dev"])
    raw_sender, raw_receiver = (
        (broker.address_for(creds["raw-pub"]), broker.address_for(creds["raw-sub"]))
        if v5
        else (coordinator_addr, coordinator_addr)
    )
    received = threading.Event()
    handed: list[float] = []

    def on_payload(_topic: str, completed: Completed) -> None:
        data = completed.data
        handed.append(time.perf_counter())
        if data != payload:
            raise RuntimeError("the device's handler got different bytes")  # logged; the wait below times out
        received.set()

    device, _ = device_session(
        _FLEET,
        "dev",
        device_addr,
        on_payload=on_payload,
        protocol=protocol,
        max_inflight=_MAX_INFLIGHT,
    )
    coordinator = coordinator_session(
        _FLEET,
        coordinator_addr,
        protocol=protocol,
        chunk_size=chunk_size,
        max_inflight=_MAX_INFLIGHT,
        limits=Limits(max_packet_bytes=settings.max_packet_bytes),
    )
    view = memoryview(payload)
    parts = [bytes(view[i : i + chunk_size]) for i in range(0, len(payload), chunk_size)]
    times: dict[str, list[float]] = {"fedfleet": [], "fedfleet_in_handler": [], "raw_chunks": []}
    times |= {"raw_single": []} if v5 else {}
    try:
        device.start()
        coordinator.start()
        for _ in range(repeats):
            times["raw_chunks"].append(raw_seconds(raw_sender, raw_receiver, raw_topic, parts, v5))
            received.clear()
            start = time.perf_counter()
            coordinator.send(topics.down, payload).wait(300)
            times["fedfleet"].append(time.perf_counter() - start)
            if not received.wait(30):
                raise RuntimeError("acked payload never reached the device's handler intact")
            times["fedfleet_in_handler"].append(handed[-1] - start)
            if v5:
                times["raw_single"].append(raw_seconds(raw_sender, raw_receiver, raw_topic, [payload], v5))
    finally:
        device.stop()
        coordinator.stop()
        broker.stop()
    return {name: len(payload) / statistics.median(values) / 1e6 for name, values in times.items()}


def run(
    size_mib: float = 45,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    repeats: int = 3,
    brokers: tuple[str, ...] = ("mosquitto", "amqtt"),
    devices: int = 8,
    fan_in_mib: float = 4,
    fan_in_repeats: int = 15,
) -> dict:
    payload = os.urandom(int(size_mib * 2**20))
    result: dict = {
        "benchmark": "transport",
        "size_mib": size_mib,
        "chunk_size": chunk_size,
        "chunks": -(-len(payload) // chunk_size),
        "repeats": repeats,
        "devices": devices,
        "fan_in_mib": fan_in_mib,
        "fan_in_repeats": fan_in_repeats,
    }
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-") as tmp:
        os.chmod(tmp, 0o711)  # a managed mosquitto runs as the mosquitto user and must enter it
        for kind in brokers:
            mbps = measure_broker(kind, payload, chunk_size, repeats, Path(tmp))
            result[f"{kind}_ratio"] = mbps["fedfleet"] / mbps["raw_chunks"]
            if "raw_single" in mbps:
                result[f"{kind}_vs_single"] = mbps["fedfleet"] / mbps["raw_single"]
            result |= {f"{kind}_{name}_mbps": value for name, value in mbps.items()}
        if devices > 0:
            fan = fan_in.measure(devices, int(fan_in_mib * 2**20), chunk_size, fan_in_repeats, Path(tmp))
            result |= {f"fan_in_{name}": value for name, value in fan.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transport",
        description="Throughput of fedfleet's verified chunked transfers vs raw paho on the same broker, same run.",
    )
    parser.add_argument("--size-mib", type=float, default=45, help="payload size in MiB (default: %(default)s)")
    parser.add_argument("--chunk-kib", type=int, default=DEFAULT_CHUNK_SIZE // 1024, help="chunk size (default: 256)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats, medians reported (default: 3)")
    parser.add_argument("--brokers", default="mosquitto,amqtt", help="comma-separated (default: %(default)s)")
    parser.add_argument(
        "--devices", type=int, default=8, help="device processes in the fan-in, 0 skips it (default: 8)"
    )
    parser.add_argument("--fan-in-mib", type=float, default=4, help="each device's upload in MiB (default: 4)")
    parser.add_argument("--fan-in-repeats", type=int, default=15, help="fan-in repeats (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    args = parser.parse_args(argv)
    if args.devices < 0 or args.fan_in_mib <= 0 or args.fan_in_repeats < 1:
        parser.error("--devices must be >= 0, --fan-in-mib > 0 and --fan-in-repeats >= 1")
    brokers = tuple(b.strip() for b in args.brokers.split(",") if b.strip())
    result = run(
        args.size_mib, args.chunk_kib * 1024, args.repeats, brokers, args.devices, args.fan_in_mib, args.fan_in_repeats
    )
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
