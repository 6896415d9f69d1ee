"""``device-agent run``: join a fleet and train whatever the coordinator assigns, until stopped."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agent.common.names import DATASETS

if TYPE_CHECKING:
    from device_agent.agent.config import AgentConfig

_EPILOG = """\
examples:
  device-agent run --config agent.yaml
  device-agent run --device pi5-01 --fleet demo --broker mqtt://broker.local:1883 \\
      --password env:FEDFLEET_PASSWORD --dataset digits --index 0 --count 8
  device-agent run --config agent.yaml --state-dir /var/lib/fedfleet   (flags override the file)
  device-agent run --kit ./pi5-01      (an unpacked kit, run where it lies; state in ./pi5-01/state)

The agent keeps every finished update under --state-dir until the coordinator acknowledges it,
so it can be stopped, rebooted or disconnected at any time without losing trained work.
"""

# flag dest -> dotted agent.yaml key
_OVERRIDES = {
    "device": "device",
    "fleet": "fleet",
    "broker": "transport.broker.url",
    "password": "transport.broker.password",
    "ca_file": "transport.broker.ca_file",
    "cert_file": "transport.broker.cert_file",
    "key_file": "transport.broker.key_file",
    "protocol": "transport.broker.protocol",
    "connect_timeout": "connect_timeout_s",
    "signing_key": "signing_key",
    "dataset": "data.dataset",
    "data_path": "data.path",
    "partition": "data.partition",
    "seed": "data.seed",
    "index": "data.index",
    "count": "data.count",
    "device_type": "device_type",
    "state_dir": "state_dir",
    "threads": "emulation.threads",
    "memory_bytes": "emulation.memory_bytes",
    "slowdown": "emulation.slowdown",
    "uplink": "emulation.uplink_bytes_per_s",
    "downlink": "emulation.downlink_bytes_per_s",
    "latency": "emulation.latency_s",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="join a fleet: connect to the broker, train the assigned rounds, upload the updates",
        description=(
            "Connect to the fleet's MQTT broker as DEVICE, send the coordinator this device's measured "
            "profile, then train every round it is assigned on local data and upload only what the "
            "strategy asks for (FedHM: factors, full-rank layers and norm parameters). Runs until Ctrl-C. "
            "Settings come from --config (agent.yaml); flags override it, and flags alone are enough."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = run.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, metavar="FILE", help="agent.yaml to read (optional with flags)")
    source.add_argument(
        "--kit",
        type=Path,
        metavar="DIR",
        help="run an unpacked kit where it lies: DIR/agent.yaml with the certificates and secrets of DIR "
        "(not the installed paths it names) and state in DIR/state",
    )
    who = run.add_argument_group("identity and broker")
    who.add_argument("--device", metavar="ID", help="device id = broker user name = topic level")
    who.add_argument("--fleet", metavar="NAME", help="fleet name (as in the coordinator's fleet.yaml)")
    who.add_argument("--broker", metavar="URL", help="mqtt://host[:port] or mqtts://host[:port]")
    who.add_argument("--password", metavar="REF", help="env:NAME or file:PATH holding the broker password")
    who.add_argument("--ca-file", metavar="FILE", help="CA certificate for mqtts://")
    who.add_argument("--cert-file", metavar="FILE", help="this device's client certificate (PEM) for mqtts://")
    who.add_argument("--key-file", metavar="FILE", help="the key of --cert-file (PEM)")
    who.add_argument("--protocol", choices=["5", "3.1.1"], help="MQTT protocol version (default 5)")
    who.add_argument(
        "--connect-timeout",
        type=float,
        metavar="S",
        help="at start-up, retry an unreachable broker with backoff for S s, then exit 1 (default 300)",
    )
    who.add_argument("--signing-key", metavar="REF", help="env:NAME or file:PATH holding this device's upload key")
    data = run.add_argument_group("local data")
    data.add_argument("--dataset", choices=DATASETS, help="default digits (built in)")
    data.add_argument("--data-path", metavar="PATH", help="folder or file for the non built-in datasets")
    data.add_argument("--partition", metavar="SCHEME", help="iid | dirichlet(ALPHA) | permuted_labels | domains[(N)]")
    data.add_argument("--seed", type=int, help="partition seed")
    data.add_argument("--index", type=int, help="this device's share among --count (emulation)")
    data.add_argument("--count", type=int, help="number of shares the data is split into (emulation)")
    place = run.add_argument_group("runtime")
    place.add_argument("--device-type", metavar="TYPE", help="auto | cpu | cuda | cuda:N | mps")
    place.add_argument("--state-dir", metavar="DIR", help="outbox, logs and last assignment")
    place.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    emu = run.add_argument_group("emulation (hold this process to a device profile)")
    emu.add_argument("--threads", type=int, help="compute threads")
    emu.add_argument("--memory-bytes", type=int, help="memory cap (RLIMIT_AS on CPU, memory fraction on CUDA)")
    emu.add_argument("--slowdown", type=float, help="compute slowdown factor >= 1")
    emu.add_argument("--uplink", type=float, metavar="BYTES_PER_S", help="upload bandwidth")
    emu.add_argument("--downlink", type=float, metavar="BYTES_PER_S", help="download bandwidth")
    emu.add_argument("--latency", type=float, metavar="SECONDS", help="one-way latency per exchange")
    run.set_defaults(handler=_run)


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """agent.yaml (if given) with the flags on top; ``ConfigError`` names the bad key."""
    from device_agent.agent.config import load_config, load_kit, merge_overrides, parse_config

    overrides: dict[str, Any] = {key: getattr(args, dest) for dest, key in _OVERRIDES.items()}
    if getattr(args, "kit", None) is not None:
        return load_kit(args.kit, overrides)
    if args.config is not None:
        return load_config(args.config, overrides)
    return parse_config(merge_overrides({}, overrides), "flags")


def _run(args: argparse.Namespace) -> int:
    from device_agent.agent.config import ConfigError

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"device-agent: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from device_agent.agent.runtime import AgentError, run_agent
    from device_agent.emulation.limits import runtime_hooks

    try:
        return run_agent(config, hooks=lambda device: runtime_hooks(config.emulation, device))
    except (AgentError, ConfigError) as exc:
        print(f"device-agent: error: {exc}", file=sys.stderr)
        return 1
