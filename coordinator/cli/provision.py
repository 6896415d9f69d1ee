"""``coordinator provision``: the fleet's startup kits (broker files, one kit and bundle per device)."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from coordinator.config.fleet import FleetError, load_fleet
from coordinator.provision import DeviceLayout, ProvisionError, WheelOptions, default_kits, provision
from coordinator.provision.device_wheels import CACHE

_EPILOG = """\
examples:
  coordinator provision --fleet examples/fleet.yaml --out kits/
  coordinator provision --fleet fleet.yaml --out kits/ --rotate pi4-02      new secrets for pi4-02 only
  coordinator provision --fleet fleet.yaml --out kits/ --broker-dir /etc/mosquitto/fedfleet
  coordinator provision --fleet fleet.yaml --out kits/ --wheels                offline kits (wheels/ per device)

Run it again whenever fleet.yaml changes: existing passwords, keys and certificates are kept, so
deployed devices keep working; new devices get new kits. Secrets are files of mode 0600 and are
never printed. Then copy kits/<device>.tar.gz to each device and follow its README (three commands),
and start the coordinator with `coordinator start --fleet fleet.yaml --kits kits/`.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "provision",
        help="write the fleet's startup kits: broker files, CA and certificates, one installable kit per device",
        description=(
            "Enrol the fleet's devices once: generate each participant's broker password, the fleet's CA, the "
            "broker's server certificate (for transport.broker.hosts) and a client certificate per device, the managed "
            "mosquitto's config, password file and per-device ACLs (kits/broker/), and per device a kit "
            "(kits/<device>/ and kits/<device>.tar.gz) with agent.yaml, its secrets, the agent wheel, install.sh, "
            "a systemd unit, cloud-init user-data and a README."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fleet", type=Path, required=True, metavar="FILE", help="fleet.yaml")
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="kits folder (default: kits/<fleet>/ next to fleet.yaml)"
    )
    parser.add_argument(
        "--rotate",
        action="append",
        default=[],
        metavar="DEVICE",
        help="replace the password and certificate of DEVICE (or of 'coordinator'); repeatable",
    )
    parser.add_argument(
        "--prefix",
        type=Path,
        default=DeviceLayout.prefix,
        metavar="DIR",
        help="where install.sh puts the agent on a device (default: %(default)s)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DeviceLayout.state_dir,
        metavar="DIR",
        help="the agent's state on a device, its systemd StateDirectory (default: %(default)s)",
    )
    parser.add_argument(
        "--broker-dir",
        type=Path,
        metavar="DIR",
        help="where kits/broker/ will live on the broker host, for the paths in mosquitto.conf (default: here)",
    )
    parser.add_argument(
        "--wheels",
        action="store_true",
        help="fill each kit's wheels/ for its device's platform (pip download), so it installs offline: "
        "Pi/arm64 = aarch64 CPython 3.11 with a CPU-only torch; Jetson = aarch64 CPython 3.10 without torch "
        "(NVIDIA's wheel is yours to add); x86 = x86_64 CPython 3.11, torch only with --torch-index",
    )
    parser.add_argument(
        "--wheels-cache",
        type=Path,
        default=CACHE,
        metavar="DIR",
        help="downloads kept here, once per platform (default: %(default)s)",
    )
    parser.add_argument(
        "--torch-index",
        metavar="URL",
        help="with --wheels: take torch (the fleet's pin) from this index, e.g. https://download.pytorch.org/whl/cpu",
    )
    parser.add_argument(
        "--wheels-from",
        type=Path,
        metavar="DIR",
        help="with --wheels: pip's --no-index --find-links DIR instead of PyPI (a local mirror of wheels)",
    )
    parser.set_defaults(handler=run_provision)


def run_provision(args: argparse.Namespace) -> int:
    try:
        fleet, _ = load_fleet(args.fleet)
        out = args.out or default_kits(args.fleet, fleet)
        wheels = WheelOptions(args.wheels_cache, args.torch_index, args.wheels_from) if args.wheels else None
        layout = DeviceLayout(args.prefix, args.state_dir)
        done = provision(fleet, out, args.rotate, layout, args.broker_dir, wheels=wheels)
    except (FleetError, ProvisionError) as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    kits = done.kits.root
    mqtt = fleet.transport.kind == "mqtt"
    reach = "the broker" if mqtt else f"the coordinator over {fleet.transport.kind}"
    print(f"fleet {fleet.fleet}: kits in {kits}/ (devices reach {reach} at {done.broker_url})")
    tls = " (TLS; a client certificate's name is its login)" if done.tls else ""
    if mqtt:
        print(f"  broker:  {kits / 'broker'}/mosquitto.conf{tls}")
    elif done.tls:
        print(f"  server:  {kits / 'broker'}/server.pem, ca.pem, crl.pem{tls}")
    for device in fleet.devices:
        note = " (rotated)" if device.id in done.rotated else ""
        if device.id in done.missing:
            note = f" INCOMPLETE: {done.missing[device.id]}"
        elif device.profile == "jetson-nano":
            note += " warning: Jetson Nano (JetPack 4, Python 3.6) cannot run the agent"
        print(f"  device:  {done.kits.bundle(device.id)}{note}")
        if device.id in done.wheels:
            print(f"           wheels/: {done.wheels[device.id]}")
    if "coordinator" in done.missing:
        print(f"  coordinator INCOMPLETE: {done.missing['coordinator']}")
    if mqtt and not fleet.broker.hosts and fleet.broker.mode != "external":
        print(
            "note: fleet.yaml has no transport.broker.hosts; kits dial this host's name. "
            "List the names/IPs devices use."
        )
    elif not mqtt and f"://{socket.gethostname()}:" in done.broker_url:
        print("note: kits dial this host's name; list the names/IPs devices use in transport.hosts.")
    if done.missing:
        print("warning: set the missing secrets and run the same command again; the rest is kept", file=sys.stderr)
    return 0
