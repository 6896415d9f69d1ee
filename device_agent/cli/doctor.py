"""``device-agent doctor``: is this device ready to join its fleet? One line per check, and a hint on failure.

Checks what a person at the device can fix, in the order they depend on each other: the config
and its secret files, the broker's address (TCP), the broker's certificate against the kit's CA
(and this clock against the certificate's validity: a Pi without a battery-backed clock often
boots in 1970), whether the device's agent is online anywhere (asked with a read-only login, so
that doctor never logs in as a running agent), the login, the device's own topics, torch and the
accelerator, the data, and the free disk and memory. A failed network check skips the ones that need it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import secrets
import shutil
import socket
import ssl
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import paho.mqtt.client as mqtt
import psutil
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

from device_agent.agent.config import AgentConfig, ConfigError, load_config, load_kit
from device_agent.agent.lock import device_key, device_running_here, running_agent
from device_agent.agent.ports import port_kind_of
from device_agent.common.names import TORCH_CPU_INDEX
from device_agent.data.datasets import DatasetError, check_source
from device_agent.wire.messages import ProtocolError, Status, encode, parse_message
from device_agent.wire.session import BrokerAddress
from device_agent.wire.tls_errors import classify, why_tls_fails
from device_agent.wire.topics import DeviceTopics, doctor_login

_MIB = 1024**2
MIN_DISK_BYTES = 1024 * _MIB
MIN_MEMORY_BYTES = 512 * _MIB
JETSON_MARKER = "/etc/nv_tegra_release"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str
    hint: str = ""
    # Works, but costs something (a CUDA torch on a device without a GPU): printed with its hint, not a failure.
    warn: bool = False

    def line(self) -> str:
        mark = "WARN" if self.warn and self.ok else {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]
        text = f"{mark}  {self.name:<22} {self.detail}"
        shown = self.hint and (self.ok is False or self.warn)
        return text + (f"\n      hint: {self.hint}" if shown else "")


def _tls_context(address: BrokerAddress) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=address.ca_file)
    if address.cert_file:
        context.load_cert_chain(address.cert_file, address.key_file)
    return context


def check_network(address: BrokerAddress, timeout: float) -> list[Check]:
    """TCP, TLS and clock: each needs the one before."""
    start = time.monotonic()
    try:
        raw = socket.create_connection((address.host, address.port), timeout=timeout)
    except OSError as exc:
        return [
            Check(
                "broker reachable",
                False,
                f"{address.host}:{address.port}: {exc.strerror or exc}",
                "is the broker running and the address in transport.broker.url right? firewall? try: ping "
                + address.host,
            )
        ]
    checks = [
        Check("broker reachable", True, f"{address.host}:{address.port} ({(time.monotonic() - start) * 1e3:.0f} ms)")
    ]
    if not address.tls:
        raw.close()
        return [
            *checks,
            Check("TLS", None, "plain mqtt:// (no TLS)"),
            Check("clock", None, "no certificate to compare"),
        ]
    try:
        with _tls_context(address).wrap_socket(raw, server_hostname=address.host) as tls:
            peer = tls.getpeercert() or {}
    except ssl.SSLCertVerificationError as exc:
        raw.close()
        problem = why_tls_fails(
            address.host, address.port, address.ca_file, address.cert_file, address.key_file, timeout
        ) or classify(exc, address.ca_file, address.host)
        return [*checks, Check("TLS verifies", False, problem.reason, problem.hint)]
    except (ssl.SSLError, OSError) as exc:
        raw.close()
        return [
            *checks,
            Check("TLS verifies", False, str(exc), "check transport.broker.ca_file, cert_file and key_file"),
        ]
    checks.append(Check("TLS verifies", True, f"broker certificate for {address.host} signed by {address.ca_file}"))
    not_before = dt.datetime.fromtimestamp(ssl.cert_time_to_seconds(peer["notBefore"]), dt.timezone.utc)
    now = dt.datetime.now(dt.timezone.utc)
    checks.append(
        Check("clock", True, f"{now:%Y-%m-%d %H:%M:%S} UTC, after the broker certificate's {not_before:%Y-%m-%d}")
    )
    return checks


def check_login(config: AgentConfig, address: BrokerAddress, timeout: float) -> list[Check]:
    """Log in as the device (MQTT 5), subscribe to its ``down`` and publish once on its ``up``: the ACLs' answer."""
    topics = DeviceTopics(config.fleet, config.device)
    down, up = topics.down, topics.status
    # The ACL names the device's topics exactly (no up/#), so the probe is a real status: "offline" is true,
    # since doctor logs in only while the agent is not running (or --force); not retained, so it replaces nothing.
    probe = encode(Status(device=config.device, state="offline", detail="device-agent doctor: checking the login"))
    events: dict[str, object] = {}
    done = {name: threading.Event() for name in ("connect", "subscribe", "publish")}

    def on_connect(_c: object, _u: object, _f: object, reason: object, _p: object) -> None:
        events["connect"] = reason
        done["connect"].set()

    def on_subscribe(_c: object, _u: object, _m: int, reasons: list, _p: object) -> None:
        events["subscribe"] = reasons[0]
        done["subscribe"].set()

    def on_publish(_c: object, _u: object, _m: int, reason: object, _p: object) -> None:
        events["publish"] = reason
        done["publish"].set()

    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        # Never the agent's own id; a broker with use_username_as_clientid replaces it with the login anyway,
        # which is why diagnose() skips this check while the agent runs.
        client_id=f"{address.username or config.device}-doctor-{secrets.token_hex(4)}",
        protocol=MQTTProtocolVersion.MQTTv5,
    )
    client.username_pw_set(address.username, address.password)
    if address.tls:
        client.tls_set_context(_tls_context(address))
    client.on_connect, client.on_subscribe, client.on_publish = on_connect, on_subscribe, on_publish
    try:
        client.connect(address.host, address.port, keepalive=10)
    except (OSError, ssl.SSLError) as exc:
        return [Check("login accepted", False, str(exc), "see the TLS check above")]
    client.loop_start()
    try:
        if not done["connect"].wait(timeout):
            return [Check("login accepted", False, "no answer from the broker", "is it an MQTT broker?")]
        reason = events["connect"]
        if getattr(reason, "is_failure", True):
            return [
                Check(
                    "login accepted",
                    False,
                    f"refused as {address.username}: {reason}",
                    "transport.broker.password is not this device's current secret (rotated? copied from another kit?)",
                )
            ]
        checks = [Check("login accepted", True, f"as {address.username}")]
        client.subscribe(down, qos=1)
        client.publish(up, probe, qos=1)
        for name, topic in (("subscribe", down), ("publish", up)):
            granted = done[name].wait(timeout) and not getattr(events[name], "is_failure", True)
            verb = "read" if name == "subscribe" else "write"
            checks.append(
                Check(
                    f"may {verb} own topics",
                    bool(granted),
                    f"{topic}: {events.get(name, 'no answer')}",
                    "the broker's ACL does not confine users to fedfleet/<fleet>/dev/<user>: wrong fleet name? "
                    "or transport.broker.cert_file is another device's "
                    "(over TLS the broker logs in the certificate's name)",
                )
            )
        return checks
    finally:
        client.disconnect()
        client.loop_stop()


RETAINED_WAIT_S = 1.0
"""After the broker grants the subscription, how long to wait for the retained status (it follows at once)."""


def ask_broker_online(config: AgentConfig, address: BrokerAddress, timeout: float) -> tuple[Check, str | None]:
    """Whether the device's agent is online anywhere, from the broker: (the check, why not to log in or None).

    Logs in with the kit's read-only doctor login (``doctor@<device>``), never as the device, and reads
    the device's retained status: an agent publishes one when it connects, the broker its will
    (``offline``) when the connection drops. A broker that cannot be asked (a kit for an external
    broker, or kits provisioned before doctor logins) is a WARN line, and only this machine's
    checks (:func:`_running_agent`) stand between doctor and the agent's session.
    """
    doctor = config.broker.doctor
    login = doctor_login(config.device)
    if doctor is None:
        return Check(
            "agent online",
            True,
            f"unknown: agent.yaml has no transport.broker.doctor login ({login}) to ask the broker with",
            "an agent of this device online on another machine would lose its session to doctor's login check: "
            "provision the kits again (coordinator provision) for a doctor login, or stop that agent first",
            warn=True,
        ), None
    try:
        password = doctor.resolve_password()
    except ConfigError as exc:
        return Check("agent online", False, str(exc), "run doctor as the agent's user (sudo) or fix the path"), None
    status_topic = DeviceTopics(config.fleet, config.device).status
    asking = replace(address, username=login, password=password, cert_file=doctor.cert_file, key_file=doctor.key_file)
    events: dict[str, object] = {}
    connected, granted, retained = threading.Event(), threading.Event(), threading.Event()

    def on_connect(_c: object, _u: object, _f: object, reason: object, _p: object = None) -> None:
        events["connect"] = reason
        connected.set()

    def on_subscribe(_c: object, _u: object, _m: int, reasons: list, _p: object = None) -> None:
        events["subscribe"] = reasons[0]
        granted.set()

    def on_message(_c: object, _u: object, message: mqtt.MQTTMessage) -> None:
        if message.retain and message.payload:
            events["status"] = message.payload
            retained.set()

    protocol = MQTTProtocolVersion.MQTTv5 if config.broker.protocol == "5" else MQTTProtocolVersion.MQTTv311
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=login, protocol=protocol)
    client.username_pw_set(asking.username, asking.password)
    if asking.tls:
        client.tls_set_context(_tls_context(asking))
    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    cannot = "could not ask the broker as " + login
    hint = (
        "kits provisioned before doctor logins, or a broker started from older kits/broker: provision again and "
        "restart the coordinator; meanwhile stop this device's agents elsewhere before doctor logs in"
    )
    try:
        client.connect(asking.host, asking.port, keepalive=10)
    except (OSError, ssl.SSLError) as exc:
        return Check("agent online", True, f"{cannot}: {exc}", hint, warn=True), None
    client.loop_start()
    try:
        if not connected.wait(timeout) or getattr(events["connect"], "is_failure", True):
            why = f"{cannot}: {events.get('connect', 'no answer')}"
            return Check("agent online", True, why, hint, warn=True), None
        client.subscribe(status_topic, qos=1)
        if not granted.wait(timeout) or getattr(events["subscribe"], "is_failure", True):
            why = f"{cannot}: reading {status_topic}: {events.get('subscribe', 'no answer')}"
            return Check("agent online", True, why, hint, warn=True), None
        retained.wait(min(RETAINED_WAIT_S, timeout))
    finally:
        client.disconnect()
        client.loop_stop()
    if "status" not in events:
        never = (
            f"no: the broker holds no status of {config.device} for {login}: its agent never connected (or the "
            "broker runs from broker files older than this kit's doctor login: restart the coordinator after provision)"
        )
        return Check("agent online", True, never), None
    try:
        status = parse_message(events["status"])  # type: ignore[arg-type]
    except ProtocolError as exc:
        status = exc
    if not isinstance(status, Status):
        return Check("agent online", True, f"{cannot}: its status is unreadable: {status}", hint, warn=True), None
    state = status.state
    said = state + (f" ({status.detail})" if status.detail else "")
    if state == "offline":
        return Check("agent online", True, f"no: the broker's last status of {config.device} is {said}"), None
    where = f"the broker says {config.device}'s agent is online ({said}), on this machine or another"
    return Check("agent online", True, f"yes: {where}"), where


def check_cpu() -> Check:
    """What the device is, for the person reading the output: a Pi 4 is ``aarch64`` with 4 CPUs."""
    return Check("cpu", True, f"{os.cpu_count() or 1} CPUs, {platform.machine() or 'unknown architecture'}")


def check_torch(config: AgentConfig, cpu_index: str = TORCH_CPU_INDEX) -> list[Check]:
    """torch imports, suits ``device_type``, and is not a multi-GB CUDA build on a device without a GPU.

    Imported here, not at the top: a missing or broken torch (a wheel for another CPU, a CUDA build
    without its NVIDIA libraries) is a FAIL line with the error, not a doctor that cannot start.
    """
    try:
        import torch
    except Exception as exc:  # ImportError, OSError (a missing .so), RuntimeError...: all mean "no torch"
        return [
            Check(
                "torch",
                False,
                f"does not import: {type(exc).__name__}: {exc}",
                f"(re)install torch into this venv: the kit's install.sh, or pip install torch --index-url {cpu_index}",
            )
        ]
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    found = f"cuda ({torch.cuda.get_device_name(0)})" if cuda else "mps" if mps else "cpu only"
    want = config.device_type
    ok = want in ("auto", "cpu") or (want.startswith("cuda") and cuda) or (want == "mps" and mps)
    jetson = Path(JETSON_MARKER).exists()
    hint = (
        "the agent's user needs group video for the GPU, and torch must be NVIDIA's JetPack wheel"
        if jetson
        else "on a Jetson, install NVIDIA's JetPack torch wheel (PyPI's aarch64 torch is a CUDA build for servers)"
    )
    checks = [Check("torch and accelerator", ok, f"torch {torch.__version__}, {found}, device_type {want}", hint)]
    built_for = getattr(torch.version, "cuda", None)
    if built_for and not cuda and not jetson:
        version = str(torch.__version__).split("+", 1)[0]
        checks.append(
            Check(
                "torch build",
                True,
                f"built for CUDA {built_for}, but this device has no usable GPU: GBs of CUDA libraries for nothing",
                f"reinstall the CPU build: pip uninstall -y torch && pip install torch=={version} --index-url "
                f"{cpu_index} (then pip uninstall the nvidia-* and triton packages)",
                warn=True,
            )
        )
    return checks


def check_data(config: AgentConfig) -> Check:
    data = config.data
    if data.dataset == "digits":
        try:
            check_source("digits")
        except DatasetError as exc:
            return Check("data", False, "built-in digits need scikit-learn, which is not installed", str(exc))
        return Check("data", True, "built-in digits (scikit-learn)")
    if data.dataset == "fashion_mnist" and data.path is None:
        try:
            check_source("fashion_mnist")
        except DatasetError as exc:
            return Check("data", False, "built-in fashion_mnist: Debian's dataset-fashion-mnist is missing", str(exc))
        return Check("data", True, "built-in fashion_mnist (Debian's dataset-fashion-mnist)")
    path = Path(str(data.path)).expanduser()
    hint = f"copy this device's {data.dataset} data to {path} (readable by the agent's user) or fix data.path"
    if not path.exists():
        return Check("data", False, f"{path}: does not exist", hint)
    try:
        entries = list(path.iterdir()) if path.is_dir() else [path] if path.stat().st_size > 0 else []
    except OSError as exc:
        return Check("data", False, f"{path}: {exc.strerror}", hint)
    if not entries:
        return Check("data", False, f"{path}: empty", hint)
    return Check("data", True, f"{path} ({len(entries)} entries)" if path.is_dir() else f"{path}")


def check_resources(config: AgentConfig) -> list[Check]:
    target = Path(config.state_dir).expanduser().resolve()
    while not target.exists():
        target = target.parent
    free = shutil.disk_usage(target).free
    memory = psutil.virtual_memory().available
    return [
        Check(
            "free disk",
            free >= MIN_DISK_BYTES,
            f"{free / _MIB:.0f} MiB free at {target}",
            f"the agent keeps updates and logs in {config.state_dir}: free at least {MIN_DISK_BYTES // _MIB} MiB",
        ),
        Check(
            "free memory",
            memory >= MIN_MEMORY_BYTES,
            f"{memory / _MIB:.0f} MiB available",
            f"training needs at least {MIN_MEMORY_BYTES // _MIB} MiB; stop other services or add swap",
        ),
    ]


def _running_agent(config: AgentConfig, address: BrokerAddress) -> str | None:
    """Which agent with this login runs on this machine, in words; None when none does.

    The state dir's lock names its pid; the machine-wide claim also finds an agent started from another
    copy of the kit (another state dir), which the lock cannot see.
    """
    pid = running_agent(config.state_dir)
    if pid is not None:
        return f"the agent is running (pid {pid or '?'}, lock in {config.state_dir})"
    key = device_key(address.host, address.port, config.fleet, config.device)
    if device_running_here(key):
        return f"an agent for {key} is running on this machine (another copy of the kit or another state dir)"
    return None


def diagnose(source: Path, timeout: float = 5.0, *, kit: bool = False, force: bool = False) -> list[Check]:
    """Every check, in order; stops early only when the config itself cannot be read.

    ``source`` is agent.yaml, or with ``kit`` an unpacked kit's folder (see ``load_kit``). While the
    agent runs, the login check is skipped unless ``force``: the broker takes the login as the client
    id, so doctor's login would disconnect the agent and could cost it a round. "Runs" means online
    anywhere, as the broker tells the kit's read-only doctor login (:func:`ask_broker_online`), or on
    this machine, from this state dir or any other (see :mod:`device_agent.agent.lock`).
    """
    try:
        config = load_kit(source) if kit else load_config(source)
        port_kind_of(config)
    except ConfigError as exc:
        return [Check("config", False, str(exc), "fix agent.yaml (the message names the key)")]
    where = f"kit {source}" if kit else str(source)
    checks = [Check("config", True, f"{where}: device {config.device}, fleet {config.fleet}")]
    if config.transport.kind != "mqtt":  # the broker, TLS and login checks below are the mqtt port's
        findings = port_kind_of(config).doctor(config, timeout)
        if findings is None:
            skipped = f"skipped: port kind {config.transport.kind!r} has no checks of the way to the coordinator"
            return [*checks, Check("coordinator", None, skipped), *_local_checks(config)]
        return [*checks, *(Check(f.name, f.ok, f.detail, f.hint) for f in findings), *_local_checks(config)]
    broker = config.broker
    try:
        password = broker.resolve_password()
        address = replace(
            BrokerAddress.from_url(broker.url, config.device, password, broker.ca_file),
            cert_file=broker.cert_file,
            key_file=broker.key_file,
        )
        for name in filter(None, (broker.ca_file, broker.cert_file, broker.key_file)):
            Path(name).read_bytes()
        config.resolve_signing_key()
    except (ConfigError, ValueError, OSError) as exc:
        detail = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) else str(exc)
        checks.append(Check("secrets readable", False, detail, "run doctor as the agent's user (sudo) or fix the path"))
        address = None
    else:
        read = "password" + (", CA, client certificate" if address.tls else "")
        checks.append(Check("secrets readable", True, read + (", signing key" if config.signing_key else "")))
    network = check_network(address, timeout) if address else [Check("broker", None, "no usable broker settings")]
    checks += network
    if address is not None and all(c.ok is not False for c in network):
        online, elsewhere = ask_broker_online(config, address, timeout)
        checks.append(online)
        running = _running_agent(config, address) or elsewhere
        if running is not None and not force:
            checks.append(
                Check(
                    "login accepted",
                    None,
                    f"skipped: {running}; logging in as {config.device} would take over its broker session. "
                    "Stop it to check, or --force",
                )
            )
        else:
            checks += check_login(config, address, timeout)
    else:
        checks.append(Check("login accepted", None, "skipped: no verified connection to the broker"))
    return checks + _local_checks(config)


def _local_checks(config: AgentConfig) -> list[Check]:
    """What this machine needs whatever the transport: CPU, torch, the data, disk and memory."""
    return [check_cpu(), *check_torch(config), check_data(config), *check_resources(config)]
