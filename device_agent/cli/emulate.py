"""``device-agent emulate``: N agents of one device profile on this host, against an external broker.

This is how an emulated fleet outgrows one machine: the coordinator (``coordinator start`` with an
external broker, or ``coordinator emulate``) runs somewhere, and each further host starts a slice
of the devices with this command. Device ids are PREFIX-NN with a global index, so hosts given
disjoint ``--first-index`` ranges never collide and their data shares stay disjoint.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from device_agent.common.names import PASSWORD_ENV
from device_agent.emulation.packing import PackingError, add_packing_arguments, describe, pack

if TYPE_CHECKING:
    from device_agent.emulation.launcher import AgentExit, AgentSpec

_EPILOG = """\
examples:
  device-agent emulate --profile raspberry-pi-5 --count 4 --broker mqtt://10.0.0.5:1883 --fleet demo
        four emulated Pi 5s: raspberry-pi-5-00 .. raspberry-pi-5-03, digits shares 0-3 of 4
  device-agent emulate --profile jetson-nano --count 8 --first-index 8 --total 16 --prefix dev \\
        --broker mqtt://10.0.0.5:1883 --fleet demo --password 'file:/etc/fedfleet/{device}.secret'
        this host's half of a 16-device fleet: dev-08 .. dev-15, shares 8-15 of 16
  device-agent emulate --profile raspberry-pi-5 --count 2 --first-index 2 --total 4 --prefix edge \\
        --broker mqtts://10.0.0.5:8883 --fleet lab --ca-file kits/ca.pem \\
        --password 'file:kits/{device}/password' \\
        --cert-file 'kits/{device}/client.pem' --key-file 'kits/{device}/client.key'
        against the coordinator's managed TLS broker, with the devices' provisioned kits copied here

The devices must be in the coordinator's fleet.yaml with these ids, and the broker must know their
logins. Ctrl-C stops every agent cleanly; an agent that dies is reported with the end of its log.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "emulate",
        help="run N emulated devices of one profile on this host against a broker",
        description=(
            "Start N real `device-agent run` processes, each held to a device profile: its compute "
            "threads, a memory cap (the profile's usable memory), a slowdown so it runs as fast as the "
            "profile relative to this host (host fp32 GFLOPS, measured once, / profile GFLOPS, at least 1) "
            "and its link's bandwidth and latency. Each agent gets an agent.yaml and a log under --run-dir. "
            "Past --pack-above agents (or with --workers/--devices-per-worker) they are packed into worker "
            "processes that host many each (`device-agent worker`): no OS caps per device there, and with no cost "
            "model on this side memory is held only by measured CUDA peaks."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--profile", required=True, help="profile name (see `coordinator profiles`) or a YAML file")
    parser.add_argument("--count", type=_at_least(1), required=True, metavar="N", help="how many agents to start here")
    parser.add_argument("--broker", required=True, metavar="URL", help="mqtt://host:port or mqtts://host:port")
    parser.add_argument("--fleet", required=True, help="fleet name, as in the coordinator's fleet.yaml")
    parser.add_argument(
        "--password",
        default=f"env:{PASSWORD_ENV}",
        metavar="REF",
        help="where each agent finds its broker password: env:NAME or file:PATH; {device} is replaced by the "
        "device id (default: %(default)s)",
    )
    parser.add_argument("--ca-file", metavar="FILE", help="CA certificate for mqtts://")
    parser.add_argument(
        "--cert-file",
        metavar="FILE",
        help="client certificate for mqtts:// ({device} is replaced by the device id); a managed TLS broker "
        "requires one: the kits' DEVICE/client.pem",
    )
    parser.add_argument("--key-file", metavar="FILE", help="its private key ({device} as for --cert-file)")
    parser.add_argument("--protocol", choices=["5", "3.1.1"], default="5", help="MQTT version (default: 5)")
    ids = parser.add_argument_group("device ids and data shares")
    ids.add_argument("--prefix", metavar="NAME", help="device ids are PREFIX-NN (default: the profile name)")
    ids.add_argument(
        "--first-index", type=_at_least(0), default=0, metavar="K", help="global index of the first device here"
    )
    ids.add_argument(
        "--total", type=_at_least(1), metavar="N", help="devices in the whole fleet (default: first-index + count)"
    )
    ids.add_argument(
        "--dataset",
        default="digits",
        metavar="NAME",
        help="digits | fashion_mnist | cifar10 | cifar100 | image_folder | npz",
    )
    ids.add_argument("--data-path", metavar="PATH", help="folder or file for the non built-in datasets")
    ids.add_argument(
        "--partition", default="iid", metavar="SCHEME", help="iid | dirichlet(ALPHA) | permuted_labels | domains"
    )
    ids.add_argument("--seed", type=int, default=0, metavar="N", help="partition seed (default: 0)")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--threads", type=_at_least(1), default=1, metavar="N", help="compute threads per agent (default: 1)"
    )
    limits.add_argument(
        "--host-gflops",
        type=float,
        metavar="F",
        help="this host's fp32 GFLOPS per agent (default: measured with --threads)",
    )
    limits.add_argument("--device-type", default="cpu", metavar="TYPE", help="cpu | cuda | cuda:N (default: cpu)")
    limits.add_argument(
        "--profile-dir", type=Path, action="append", default=[], metavar="DIR", help="extra profile folder (repeatable)"
    )
    parser.add_argument(
        "--run-dir", type=Path, metavar="DIR", help="agent.yaml files, state and logs (default: ./emulated-PREFIX)"
    )
    add_packing_arguments(parser)
    parser.set_defaults(handler=_emulate)


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def agent_specs(args: argparse.Namespace, host_gflops: float) -> list[AgentSpec]:
    """Write one agent.yaml per device and return what to launch."""
    from device_agent.common.paths import anchor, anchor_secret
    from device_agent.emulation.launcher import AgentSpec
    from device_agent.emulation.profile_config import (
        DataShare,
        EmulationError,
        agent_config,
        find_profile,
        limits_for,
        write_agent_config,
    )

    profile = find_profile(args.profile, args.profile_dir)
    prefix = args.prefix or profile.name
    total = args.total if args.total is not None else args.first_index + args.count
    if args.first_index + args.count > total:
        raise EmulationError(
            f"--first-index {args.first_index} + --count {args.count} exceeds --total {total} data shares"
        )
    if (args.cert_file is None) != (args.key_file is None):
        raise EmulationError("--cert-file and --key-file go together (a client certificate and its key)")
    limits = limits_for(profile, host_gflops, args.threads)
    run_dir = (args.run_dir or Path(f"emulated-{prefix}")).resolve()
    # Flags are relative to the working directory; the agent.yaml written here is read relative to itself.
    here = Path.cwd()
    specs = []
    for index in range(args.first_index, args.first_index + args.count):
        device = f"{prefix}-{index:02d}"
        folder = run_dir / device
        share = DataShare(args.dataset, args.partition, args.seed, index, total, anchor(args.data_path, here))
        config = agent_config(
            device,
            args.fleet,
            args.broker,
            share,
            folder / "state",
            limits,
            password=anchor_secret(args.password.replace("{device}", device), here),
            ca_file=anchor(args.ca_file, here),
            cert_file=anchor(_for(args.cert_file, device), here),
            key_file=anchor(_for(args.key_file, device), here),
            protocol=args.protocol,
            device_type=args.device_type,
        )
        specs.append(AgentSpec(device, write_agent_config(folder / "agent.yaml", config), folder / "agent.log"))
    return specs


def _for(template: str | None, device: str) -> str | None:
    return None if template is None else template.replace("{device}", device)


def _emulate(args: argparse.Namespace) -> int:
    # Imported here: the parser above is built by `device-agent --help`, which needs no torch.
    from device_agent.data.mapped import share_fitted_sets
    from device_agent.emulation.launcher import AgentGroup, pack_specs, worker_command
    from device_agent.emulation.profile_config import EmulationError, measure_host_gflops

    try:
        slices = pack(args.count, args.workers, args.devices_per_worker, args.pack_above)
        host_gflops = args.host_gflops or measure_host_gflops(args.threads, args.device_type)
        specs = agent_specs(args, host_gflops)
        if slices is not None:
            specs = pack_specs(specs, slices, specs[0].log.parent.parent / "workers")
    except (EmulationError, PackingError, ValueError) as exc:
        print(f"device-agent: error: {exc}", file=sys.stderr)
        return 2
    crashed: list[AgentExit] = []
    done = threading.Event()

    def on_exit(exit_: AgentExit) -> None:
        if exit_.crashed:
            crashed.append(exit_)
        print(exit_.describe(), file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, lambda *_: done.set())
    share_fitted_sets()  # every agent process maps one copy of the data set
    group = AgentGroup(lambda agent_list: worker_command(agent_list, args.threads)) if slices else AgentGroup()
    with group as agents:
        for spec in specs:
            agents.start(spec)
        agents.watch(on_exit)
        print(
            f"{args.count} x {args.profile}: {describe(args.count, slices)} running (host {host_gflops:.1f} GFLOPS "
            f"per agent); logs in {specs[0].log.parent.parent}. Ctrl-C stops them.",
            flush=True,
        )
        try:
            while agents.running() and not done.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        agents.stop()
        if agents.killed:
            print(f"killed after not stopping in time: {', '.join(agents.killed)}", file=sys.stderr)
    if crashed:
        print(
            f"{len(crashed)} of {len(specs)} agent processes crashed: {', '.join(e.device for e in crashed)}",
            file=sys.stderr,
        )
        return 1
    return 0
