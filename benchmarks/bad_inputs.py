"""Bad inputs from a device with its own credentials, against a running engine over real mosquitto.

Two devices take part in one FedHM round on digits: ``honest`` (a scripted device that trains its
assignment for real) and ``mallory``, a hand-rolled client speaking the wire protocol with its own
login, which first leaves retained messages behind, then sends one bad input of each kind, then its
genuine update. Each kind reports whether it was refused, under which reason (the engine's
``refusals`` counter, or what the transport answered), how many log lines it cost, and whether
the round went on undisturbed: the honest device's update (sent after the flood) and mallory's own
genuine update are accepted, and the round closes with a finite global model.

    python -m benchmarks.bad_inputs --json [--flood 20000]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import torch
import yaml
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.rounds.upload_gate import REASONS
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.broker.base import BrokerSettings
from coordinator.transport.broker.credentials import generate_credentials
from coordinator.transport.broker.mosquitto import MosquittoBroker, find_mosquitto
from coordinator.transport.link import MqttLink
from device_agent.agent.probe import probe_device
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.local_round import train_assignment
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.guard import InboundLimits
from device_agent.wire.messages import (
    Ack,
    Assignment,
    Hello,
    Manifest,
    Message,
    Nack,
    Receipt,
    RoundFailed,
    Status,
    encode,
    parse_message,
)
from device_agent.wire.protocol import UPDATE_KIND, upload_meta
from device_agent.wire.session import BrokerAddress, device_session
from device_agent.wire.topics import DeviceTopics
from device_agent.wire.transfer import (
    Completed,
    IncomingTransfers,
    Limits,
    announce,
    chunk_frame,
    is_chunk_frame,
    make_manifest,
    parse_chunk_frame,
)

FLEET = "gate"
HONEST, MALLORY = "honest", "mallory"
MODEL = ModelSpec("cnn", 10, 1, 8)
QUIET_S = 0.3
"""The guard's burst window here: kinds are spaced past it, so each refusal starts a burst and is logged."""


@dataclass
class Outcome:
    refused: bool
    reason: str
    round_unaffected: bool
    detail: str
    log_lines: int

    def as_dict(self) -> dict:
        return self.__dict__.copy()


class LogLines(logging.Handler):
    """Every fedfleet log line that names mallory."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if MALLORY in message and record.levelno >= logging.WARNING:
            self.lines.append(f"{record.levelname} {record.name}: {message}")


class Mallory:
    """One raw MQTT connection with mallory's login: publishes anything, receives its own down topic."""

    def __init__(self, address: BrokerAddress) -> None:
        self.topics = DeviceTopics(FLEET, MALLORY)
        self.messages: list[Message] = []
        self.assignment: Assignment | None = None
        self.payloads: dict[str, Completed] = {}
        self.got = threading.Condition()
        self._receiver = IncomingTransfers()
        self._repairable: dict[str, tuple[Manifest, bytes]] = {}
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id="anything", protocol=MQTTProtocolVersion.MQTTv5
        )
        self.client.username_pw_set(address.username, address.password)
        self.client.on_message = self._on_message
        self.client.connect(address.host, address.port)
        self.client.loop_start()
        self.client.subscribe(self.topics.down, qos=1)

    def _on_message(self, _client: mqtt.Client, _userdata: object, msg: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        if is_chunk_frame(msg.payload):
            transfer, index, chunk, digest = parse_chunk_frame(msg.payload)
            replies, completed = self._receiver.on_chunk(transfer, index, bytes(chunk), digest, now)
        else:
            message = parse_message(msg.payload)
            replies, completed = [], None
            if isinstance(message, Manifest):
                replies, completed = self._receiver.on_manifest(message, now)
            elif isinstance(message, Nack) and message.transfer in self._repairable:
                self._repair(message)
            with self.got:
                self.messages.append(message)
                if isinstance(message, Assignment):
                    self.assignment = message
                self.got.notify_all()
        for reply in replies:
            self.client.publish(self.topics.up, encode(reply), qos=1)
        if completed is not None:
            with self.got:
                self.payloads[completed.manifest.transfer] = completed
                self.got.notify_all()

    def _repair(self, nack: Nack) -> None:
        """Resend what the receiver misses, as an agent does (from paho's thread: no waiting here)."""
        manifest, data = self._repairable[nack.transfer]
        size = manifest.chunk_size
        frames = [chunk_frame(manifest.transfer, i, data[i * size : (i + 1) * size]) for i in nack.missing]
        for frame in frames or [encode(manifest)]:
            self.client.publish(self.topics.up, frame, qos=1)

    def publish(self, data: bytes, topic: str | None = None, retain: bool = False) -> None:
        self.client.publish(topic or self.topics.up, data, qos=1, retain=retain).wait_for_publish(5)

    def send(self, message: Message, topic: str | None = None, retain: bool = False) -> None:
        self.publish(encode(message), topic, retain)

    def upload(
        self,
        data: bytes,
        meta: dict[str, str],
        chunk_size: int = 64 * 1024,
        repeat: int = 1,
        repair: bool = False,
        **fields,
    ) -> Manifest:
        """A complete, well-formed transfer of ``data`` (whatever ``data`` is), each chunk sent ``repeat`` times.

        ``repair``: answer the receiver's nacks for it, as an agent does (a frame the rate limit dropped
        after a flood is then sent again instead of leaving the transfer open until the round closes).
        """
        assert self.assignment is not None
        manifest_fields = {"run": self.assignment.run, "round": self.assignment.round, "kind": UPDATE_KIND} | fields
        manifest = make_manifest(data, chunk_size, meta=meta, **manifest_fields)
        if repair:
            self._repairable[manifest.transfer] = (manifest, data)
        self.send(manifest)
        for index in range(manifest.chunk_count):
            frame = chunk_frame(manifest.transfer, index, data[index * chunk_size : (index + 1) * chunk_size])
            for _ in range(repeat):
                self.publish(frame)
        return manifest

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.got:
            return self.got.wait_for(predicate, timeout)

    def since(self, start: int, kind: type) -> list:
        with self.got:
            return [m for m in self.messages[start:] if isinstance(m, kind)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class HonestDevice:
    """Trains its assignment for real and uploads it once ``go`` is set; records its receipts."""

    def __init__(self, address: BrokerAddress, shard, test, go: threading.Event) -> None:
        self.shard, self.test, self.go = shard, test, go
        self.receipts: list[Receipt] = []
        self._assignment: Assignment | None = None
        self._payloads: dict[str, Completed] = {}
        self._lock = threading.Lock()
        self.session, self.topics = device_session(
            FLEET, HONEST, address, on_message=self._on_message, on_payload=self._on_payload
        )

    def start(self) -> None:
        self.session.start()
        profile = probe_device(0.05)
        self.session.publish(self.topics.up, Hello(device=HONEST, agent_version="bench", profile=profile), True)
        self.session.publish(self.topics.status, Status(device=HONEST, state="idle"), True)

    def _on_message(self, _topic: str, message: Message) -> None:
        if isinstance(message, Receipt):
            self.receipts.append(message)
        elif isinstance(message, Assignment):
            with self._lock:
                self._assignment = message
            self._maybe_train()

    def _on_payload(self, _topic: str, completed: Completed) -> None:
        with self._lock:
            self._payloads[completed.manifest.transfer] = completed
        self._maybe_train()

    def _maybe_train(self) -> None:
        with self._lock:
            assignment = self._assignment
            completed = self._payloads.get(assignment.download) if assignment else None
            if assignment is None or completed is None:
                return
            self._assignment = None
        threading.Thread(target=self._train, args=(assignment, completed), daemon=True).start()

    def _train(self, assignment: Assignment, completed: Completed) -> None:
        data, meta = trained_update(assignment, completed, self.shard, self.test)
        self.go.wait()
        self.session.send(self.topics.up, data, run=assignment.run, round=assignment.round, kind=UPDATE_KIND, meta=meta)

    def stop(self) -> None:
        self.session.stop()


def trained_update(assignment: Assignment, completed: Completed, shard, test) -> tuple[bytes, dict[str, str]]:
    trained = train_assignment(assignment.spec, assignment.train, decode_tensors(completed.data), None, shard, test)
    result = trained.result
    meta = upload_meta(result.samples, result.seconds, result.mean_loss, trained.local_accuracy)
    return encode_tensors(trained.upload), meta


@dataclass
class Bench:
    """What the attacks need: mallory's connection, the engine under attack and its log."""

    mallory: Mallory
    engine: RoundEngine
    honest: HonestDevice
    logs: LogLines
    genuine: dict[str, torch.Tensor]
    """Mallory's honestly trained update: every payload kind tampers with a copy of it."""
    meta: dict[str, str]

    def refusals(self) -> Counter[str]:
        return mallory_refusals(self.engine)

    def gate_refusals(self) -> int:
        """Uploads the engine refused: how many payloads reached it."""
        return sum(n for reason, n in self.refusals().items() if reason in REASONS)

    def tampered(self, change: Callable[[dict[str, torch.Tensor]], None]) -> bytes:
        tensors = {k: v.clone() for k, v in self.genuine.items()}
        change(tensors)
        return encode_tensors(tensors)


def _first_float(tensors: dict[str, torch.Tensor]) -> str:
    return next(k for k, v in tensors.items() if v.is_floating_point() and v.dim() >= 2)


def _set(key_of: Callable[[dict], str], value: Callable[[torch.Tensor], torch.Tensor]):
    def change(tensors: dict[str, torch.Tensor]) -> None:
        key = key_of(tensors)
        tensors[key] = value(tensors[key])

    return change


def _drop_all_but_one(tensors: dict[str, torch.Tensor]) -> None:
    keep = _first_float(tensors)
    for key in [k for k in tensors if k != keep]:
        del tensors[key]


def _raw_safetensors(header: dict, body: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _bad_status_json() -> bytes:
    return json.dumps({"v": 3, "type": "status", "device": MALLORY, "state": "idle", "mood": "sneaky"}).encode()


def _profile_with(value: str) -> bytes:
    hello = json.loads(encode(Hello(device=MALLORY, agent_version="x", profile=probe_device(0.01))))
    hello["profile"]["compute"]["fp32_gflops"] = "__VALUE__"
    return json.dumps(hello).replace('"__VALUE__"', value).encode()


# kind -> (what mallory does, the reason it must be refused under: engine-counted unless noted)
Attack = Callable[[Bench], None]


def payload_kinds() -> dict[str, tuple[Attack, str]]:
    def up(change=None, meta=None, data=None, repeat=1, **fields) -> Attack:
        def attack(b: Bench) -> None:
            payload = data(b) if data else (b.tampered(change) if change else encode_tensors(b.genuine))
            b.mallory.upload(payload, meta(b) if meta else b.meta, repeat=repeat, **fields)

        return attack

    def meta_with(**values) -> Callable[[Bench], dict[str, str]]:
        return lambda b: {**b.meta, **values}

    first = _first_float
    return {
        "wrong_run": (up(run="some-other-run"), "wrong_run"),
        "wrong_round": (up(round=99), "wrong_round"),
        "wrong_kind": (up(kind="assignment"), "wrong_kind"),
        "meta_nan_loss": (up(meta=meta_with(loss="nan")), "bad_meta"),
        "meta_inf_loss": (up(meta=meta_with(loss="inf")), "bad_meta"),
        "meta_absurd_train_seconds": (up(meta=meta_with(train_seconds="1e30")), "bad_meta"),
        "meta_negative_samples": (up(meta=meta_with(samples="-5")), "bad_meta"),
        "meta_huge_samples": (up(meta=meta_with(samples=str(10**12))), "bad_meta"),
        "meta_huge_local_accuracy": (up(meta=meta_with(local_accuracy="7.5")), "bad_meta"),
        "meta_missing_fields": (up(meta=lambda b: {"samples": "10"}), "bad_meta"),
        "meta_flood_of_entries": (up(meta=lambda b: {**b.meta, **{f"k{i}": "v" for i in range(100)}}), "bad_meta"),
        "truncated_safetensors": (up(data=lambda b: encode_tensors(b.genuine)[:-100]), "bad_payload"),
        "huge_header_safetensors": (up(data=lambda b: struct.pack("<Q", 1 << 60) + b"{}"), "bad_payload"),
        "lying_header_safetensors": (
            up(data=lambda b: _raw_safetensors({"w": {"dtype": "F32", "shape": [10**9], "data_offsets": [0, 4]}})),
            "bad_payload",
        ),
        "float64_tensor": (up(_set(first, lambda v: v.double())), "bad_dtype"),
        "bfloat16_tensor": (up(_set(first, lambda v: v.bfloat16())), "bad_dtype"),
        "float8_tensor": (up(_set(first, lambda v: v.to(torch.float8_e4m3fn))), "bad_dtype"),
        "wrong_shape": (up(_set(first, lambda v: v[:-1])), "bad_shape"),
        "extra_tensor": (up(lambda t: t.__setitem__("backdoor.weight", torch.zeros(3))), "unknown_tensor"),
        "missing_tensors": (up(_drop_all_but_one), "missing_tensor"),
        "nan_values": (up(_set(first, lambda v: torch.full_like(v, math.nan))), "non_finite"),
        "duplicate_chunks": (up(_set(first, lambda v: torch.full_like(v, math.nan)), repeat=3), "non_finite"),
        "inf_values": (up(_set(first, lambda v: torch.full_like(v, math.inf))), "non_finite"),
        "huge_values": (up(_set(first, lambda v: torch.full_like(v, 3e38))), "out_of_bounds"),
        "norm_scaled_update": (up(lambda t: t.update({k: v * 100 for k, v in t.items()})), "norm_too_large"),
    }


def control_kinds() -> dict[str, tuple[Attack, str]]:
    return {
        "malformed_json": (lambda b: b.mallory.publish(b"{this is not json"), "malformed"),
        "unknown_version": (
            lambda b: b.mallory.publish(json.dumps({"v": 99, "type": "status", "device": MALLORY}).encode()),
            "malformed",
        ),
        "unknown_field": (lambda b: b.mallory.publish(_bad_status_json()), "malformed"),
        "oversize_message": (lambda b: b.mallory.publish(b'{"v": 3, "pad": "' + b"x" * (2 << 20) + b'"}'), "malformed"),
        "status_naming_another_device": (
            lambda b: b.mallory.send(Status(device=HONEST, state="offline"), b.mallory.topics.status),
            "wrong_sender",
        ),
        "hello_as_another_device": (
            lambda b: b.mallory.send(Hello(device=HONEST, agent_version="x", profile=probe_device(0.01))),
            "wrong_sender",
        ),
        "hello_infinite_compute": (lambda b: b.mallory.publish(_profile_with("Infinity")), "bad_message"),
        "oversize_transfer": (
            lambda b: b.mallory.send(_manifest(size=3 << 30, chunk_size=1 << 20)),
            "transfer_refused",
        ),
        "tiny_chunks_manifest": (lambda b: b.mallory.send(_manifest(size=10**9, chunk_size=1)), "transfer_refused"),
        "too_many_open_transfers": (_open_transfers, "transfer_evicted"),
        "forged_chunk": (_forged_chunk, "corrupt_chunk"),
    }


def _manifest(size: int, chunk_size: int) -> Manifest:
    """An unsealed manifest, past the sender-side limits an honest session would apply."""
    return announce(size, chunk_size, kind=UPDATE_KIND, limits=Limits(1 << 62, 1 << 62))


def _open_transfers(b: Bench) -> None:
    for _ in range(InboundLimits().max_open_transfers + 1):
        b.mallory.send(_manifest(size=1 << 20, chunk_size=64 * 1024))


def _forged_chunk(b: Bench) -> None:
    data = os.urandom(64 * 1024)
    manifest = make_manifest(data, 64 * 1024, kind=UPDATE_KIND)
    b.mallory.send(manifest)
    forged = bytearray(chunk_frame(manifest.transfer, 0, data))
    forged[-1] ^= 0xFF  # the bytes no longer match the digest in the frame and the seal
    b.mallory.publish(bytes(forged))


def run_kind(b: Bench, attack: Attack, reason: str, timeout: float = 8.0) -> Outcome:
    before, lines = b.refusals(), len(b.logs.lines)
    attack(b)
    deadline = time.monotonic() + timeout
    while b.refusals()[reason] <= before[reason] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(QUIET_S + 0.1)  # past the guard's burst window, and any second log line would be in
    after = b.refusals()
    counted = {r: after[r] - before[r] for r in after if after[r] > before[r]}
    return Outcome(counted.get(reason, 0) > 0, reason, True, *describe(b.logs.lines[lines:], reason, counted))


def describe(new: list[str], reason: str, counted: dict[str, int]) -> tuple[str, int]:
    """(the log line of this refusal, how many lines it cost); a side effect (an old transfer evicted) is noted."""
    own = [
        line for line in new if f"({reason})" in line or "rejected mallory's update" in line or "mallory sent" in line
    ]
    detail = own[0] if own else f"no log line; refusals counted: {counted}"
    others = sorted({r for r in counted if r != reason})
    if others:
        detail += f" [also counted meanwhile: {', '.join(others)}]"
    return detail, len(own)


def transport_kinds(b: Bench) -> dict[str, Outcome]:
    """Kinds the transport repairs or answers itself (nothing reaches the engine, nothing to count)."""
    out: dict[str, Outcome] = {}
    mallory = b.mallory
    # Missing chunks: a sealed manifest and no chunk; the receiver asks for them and never delivers.
    start, events = len(mallory.messages), b.gate_refusals()
    data = os.urandom(3 * 64 * 1024)
    manifest = make_manifest(data, 64 * 1024, run=mallory.assignment.run, round=1, kind=UPDATE_KIND, meta=b.meta)
    mallory.send(manifest)
    nacked = mallory.wait(lambda: any(n.transfer == manifest.transfer for n in mallory.since(start, Nack)), 6)
    out["missing_chunks"] = Outcome(
        nacked and b.gate_refusals() == events,
        "incomplete_transfer",
        True,
        f"the receiver nacked chunks {[n.missing for n in mallory.since(start, Nack)][:1]}; nothing was delivered",
        0,
    )
    # A replayed transfer: the manifest of one already delivered (and refused) is answered with its ack, not redone.
    bad = b.tampered(_set(_first_float, lambda v: torch.full_like(v, math.nan)))
    first = mallory.upload(bad, b.meta)
    mallory.wait(lambda: any(a.transfer == first.transfer for a in mallory.since(start, Ack)), 6)
    time.sleep(0.5)
    refusals = b.gate_refusals()
    start = len(mallory.messages)
    mallory.send(first)
    for index in range(first.chunk_count):  # and its chunks again
        mallory.publish(chunk_frame(first.transfer, index, bad[index * 64 * 1024 : (index + 1) * 64 * 1024]))
    acked = mallory.wait(lambda: any(a.transfer == first.transfer for a in mallory.since(start, Ack)), 6)
    time.sleep(0.5)
    out["replayed_transfer"] = Outcome(
        acked and b.gate_refusals() == refusals,
        "replayed_transfer",
        True,
        "the receiver re-acked the finished transfer and handed nothing to the engine again",
        0,
    )
    return out


def flood(b: Bench, count: int) -> Outcome:
    """``count`` fresh manifests as fast as mallory can publish; what comes back and what it costs others."""
    before, lines = b.refusals(), len(b.logs.lines)
    start = len(b.mallory.messages)
    began = time.monotonic()
    for _ in range(count):
        b.mallory.client.publish(b.mallory.topics.up, encode(_manifest(1 << 20, 64 * 1024)), qos=0)
    sent_s = time.monotonic() - began
    settle(b)
    waited = time.monotonic() - began - sent_s
    answers = len(b.mallory.since(start, Nack)) + sum(1 for m in b.mallory.messages[start:] if not isinstance(m, Ack))
    limited = b.refusals()["rate_limited"] - before["rate_limited"]
    line, lines_cost = describe(b.logs.lines[lines:], "rate_limited", {})
    detail = (
        f"{count} manifests published in {sent_s:.1f} s: {limited} dropped unanswered by the rate limit, "
        f"{answers} answers back ({answers / (sent_s + waited):.1f}/s; the broker drops what it cannot queue); "
        f"log: {line}"
    )
    return Outcome(limited > 0, "rate_limited", True, detail, lines_cost)


def settle(b: Bench, timeout: float = 60.0) -> None:
    """Wait until the flood's backlog is drained (the count stops growing), then for mallory's bucket to refill."""
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        now_count = b.refusals().total()
        if now_count != last:
            last, stable_since = now_count, time.monotonic()
        elif time.monotonic() - stable_since > 1.0:
            break
        time.sleep(0.1)
    limits = InboundLimits()
    time.sleep(limits.burst / limits.messages_per_s)


def retained_poison(mallory: Mallory, run: str) -> None:
    """Before the coordinator starts: retained messages it must not act on when it subscribes."""
    manifest = announce(1 << 20, 64 * 1024, run=run, round=1, kind=UPDATE_KIND)
    mallory.send(manifest, retain=True)
    # Sub-topics of its own: the broker's ACL names each device's topics exactly, so these never arrive,
    # and a topic retains one message: what reaches the coordinator is the manifest and the status below.
    mallory.publish(chunk_frame(manifest.transfer, 0, b"x" * 1024), f"{mallory.topics.base}/up/junk", retain=True)
    mallory.send(RoundFailed(run=run, round=1, reason="error"), f"{mallory.topics.base}/up/failed", retain=True)
    mallory.send(Status(device=HONEST, state="offline"), mallory.topics.status, retain=True)


def _fleet(tmp: Path, port: int) -> dict:
    return {
        "fleet": FLEET,
        "transport": {"broker": {"mode": "external", "url": f"mqtt://127.0.0.1:{port}"}},
        "model": {"arch": MODEL.arch, "num_classes": MODEL.num_classes, "in_channels": MODEL.in_channels},
        "dataset": {"name": "digits", "seed": 0},
        "strategy": {"name": "fedhm"},
        "ratios": [1, 0.5],
        "rounds": 1,
        "participation": 1.0,
        "round_deadline_s": 300,
        "quorum": 1.0,
        "training": {"batch_size": 32, "local_epochs": 1, "lr": 0.05},
        "devices": [{"id": d, "profile": "simulated", "overrides": {"samples": 800}} for d in (HONEST, MALLORY)],
    }


def run(flood_count: int = 20_000, kinds: list[str] | None = None) -> dict:
    """Every kind (or ``kinds``) against one round; returns {"bad_inputs": {kind: outcome}}."""
    catalog = {**control_kinds(), **payload_kinds()}
    chosen = list(catalog) if kinds is None else kinds
    unknown = sorted(
        set(chosen) - set(catalog) - {"retained_poisoning", "flood", "missing_chunks", "replayed_transfer"}
    )
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; choose from {sorted(catalog)}")
    if find_mosquitto() is None:
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
    data = load_dataset("digits", MODEL.image_size, 1)
    split = PartitionSpec("iid", 2, seed=0)
    shards = [client_shard(data.train_x, data.train_y, split, i) for i in range(2)]
    tests = [client_shard(data.test_x, data.test_y, split, i) for i in range(2)]
    logs = LogLines()
    logging.getLogger("fedfleet").addHandler(logs)
    with tempfile.TemporaryDirectory(prefix="fedfleet-bad-inputs-") as tmp_name:
        tmp = Path(tmp_name)
        os.chmod(tmp, 0o711)  # mosquitto may run as its own user
        credentials = generate_credentials([HONEST, MALLORY])
        broker = MosquittoBroker(BrokerSettings(FLEET, tmp / "broker", credentials))
        broker.start()
        mallory = honest = engine = None
        results: dict[str, Outcome] = {}
        try:
            fleet_file = tmp / "fleet.yaml"
            fleet_file.write_text(yaml.safe_dump(_fleet(tmp, broker.port)))
            fleet = parse_fleet(yaml.safe_load(fleet_file.read_text()))
            strategy = build_strategy("fedhm", MODEL, {}, seed=0)
            rundir = RunDir.create(tmp / "run", fleet_file, strategy.state_dict(), seed=0)
            mallory = Mallory(broker.address_for(credentials[MALLORY]))
            retained_poison(mallory, rundir.run_id)
            go = threading.Event()
            honest = HonestDevice(broker.address_for(credentials[HONEST]), shards[0], tests[0], go)
            honest.start()
            calibration = data.train_x[:256]
            engine = RoundEngine(
                fleet,
                {},
                strategy,
                rundir,
                LabeledData(calibration, calibration.new_zeros(len(calibration)), data.test_x, data.test_y, 10),
                MqttLink(FLEET, broker.address, limits=InboundLimits(quiet_s=QUIET_S)),
                # Mallory keeps sending for longer than the default grace after a refusal: the round waits for it.
                EngineSettings(min_devices=2, wait_timeout_s=60, calibration_samples=256, rejected_grace_s=120),
                planner=fixed_levels({HONEST: 1.0, MALLORY: 0.5}),
            )
            crashed: list[BaseException] = []

            def serve() -> None:
                try:
                    engine.run()
                except BaseException as exc:  # reported as the round being disturbed
                    crashed.append(exc)

            thread = threading.Thread(target=serve, name="bad-inputs-engine", daemon=True)
            thread.start()
            time.sleep(1.0)  # subscribed: the retained poison has arrived
            poison = mallory_refusals(engine)
            results["retained_poisoning"] = Outcome(
                poison["retained"] >= 1 and poison["wrong_sender"] >= 1 and not crashed,
                "retained",
                True,
                f"refusals counted: {dict(poison)}",
                sum("retained" in line for line in logs.lines),
            )
            mallory.send(Hello(device=MALLORY, agent_version="x", profile=probe_device(0.01)))
            mallory.send(Status(device=MALLORY, state="idle"), mallory.topics.status)
            if not mallory.wait(
                lambda: mallory.assignment is not None and mallory.assignment.download in mallory.payloads, 60
            ):
                raise RuntimeError("mallory got no assignment: the round did not start")
            assignment = mallory.assignment
            data_bytes, meta = trained_update(assignment, mallory.payloads[assignment.download], shards[1], tests[1])
            bench = Bench(mallory, engine, honest, logs, decode_tensors(data_bytes), meta)
            for kind in chosen:
                if kind in catalog:
                    attack, reason = catalog[kind]
                    results[kind] = run_kind(bench, attack, reason)
                    if crashed:
                        break
            # "unknown_version" got mallory marked refused and offline (another protocol version), and the
            # round stops waiting for an offline device: say hello again, as a fixed agent would, or its
            # genuine update races the honest one against the round's close.
            mallory.send(Hello(device=MALLORY, agent_version="x", profile=probe_device(0.01)))
            if kinds is None or "flood" in kinds:
                results["flood"] = flood(bench, flood_count)
            go.set()  # the honest device uploads now, right after the flood
            if kinds is None or {"missing_chunks", "replayed_transfer"} & set(kinds):
                results |= transport_kinds(bench)
            mallory.upload(data_bytes, meta, repair=True)  # its genuine update, after all its refused ones
            thread.join(timeout=120)
            metrics = rundir.metrics()
            closed = not thread.is_alive() and not crashed and len(metrics) == 1
            statuses = {d: m.status for d, m in metrics[0].devices.items()} if closed else {}
            finite = all(
                bool(torch.isfinite(v).all()) for v in strategy.global_state().values() if v.is_floating_point()
            )
            unaffected = closed and finite and statuses.get(HONEST) == "accepted"
            summary = f"round closed: {closed}, statuses {statuses}, global model finite: {finite}"
            if crashed:
                summary += f"; engine crashed: {crashed[0]!r}"
            for outcome in results.values():
                outcome.round_unaffected = unaffected
            results["refused_then_genuine"] = Outcome(
                statuses.get(MALLORY) == "accepted", "accepted_after_refusals", unaffected, summary, 0
            )
        finally:
            if engine is not None:
                engine.stop()
            if honest is not None:
                honest.stop()
            if mallory is not None:
                mallory.close()
            broker.stop()
            logging.getLogger("fedfleet").removeHandler(logs)
    return {"bad_inputs": {kind: outcome.as_dict() for kind, outcome in results.items()}}


def mallory_refusals(engine: RoundEngine) -> Counter[str]:
    """Mallory's refusals by reason, read from the engine thread's counter."""
    for _ in range(10):
        try:
            return Counter({r: n for (d, r), n in list(engine.refusals.items()) if d == MALLORY})
        except RuntimeError:  # the engine thread added a key while we copied
            time.sleep(0.01)
    raise RuntimeError("could not read the engine's refusals")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bad_inputs",
        description="Send every kind of bad input from one device over real mosquitto to a running engine; "
        "report how each was refused and whether the round went on.",
    )
    parser.add_argument("--flood", type=int, default=20_000, help="manifests in the flood (default: %(default)s)")
    parser.add_argument("--kinds", help="comma-separated subset of kinds (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")
    args = parser.parse_args(argv)
    if args.flood < 1:
        parser.error("--flood must be >= 1")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    try:
        result = run(args.flood, kinds)
    except (RuntimeError, ValueError) as exc:
        parser.exit(2, f"bad_inputs: {exc}\n")
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
