"""``device-agent``: the command line of the runtime flashed onto Jetsons, Raspberry Pis and laptops.

``probe`` measures the device; ``run`` (device_agent.cli.run) joins a fleet and trains; ``infer``
(device_agent.infer) classifies with an exported model. Torch is imported only by the commands that
train or probe, so ``infer`` runs on a device that has onnxruntime and numpy alone.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from device_agent import __version__, infer
from device_agent.cli.errors import DEBUG_FLAG, DEBUG_HELP, debug_requested, guarded
from device_agent.cli.needs import install_hint, missing_packages

if TYPE_CHECKING:
    from device_agent.common.profile import DeviceProfile

_GIB = 1024**3

_DESCRIPTION = """\
The fedfleet device agent: the small runtime that lets this device take part in federated
learning. The coordinator sizes each device's share of the work (its FedHM rank, its round
deadline) from a profile the agent measures on the device itself, since a throttled Raspberry Pi
or a Jetson in a low power mode is far from its datasheet.

"probe" measures that profile; "run" joins a fleet and trains the rounds it is assigned.
"""

_EPILOG = """\
examples:
  device-agent run --config agent.yaml  join the fleet described in agent.yaml
  device-agent doctor --config agent.yaml
                                        check broker, TLS, login, topics, torch, data, disk
  device-agent run --kit ./pi5-01       run an unpacked kit where it lies (state in ./pi5-01/state)
  device-agent probe                    measure and print the profile as JSON
  device-agent probe --broker mqtt://broker.local:1883
                                        also measure latency and throughput to the broker
  device-agent probe --human            the same, as a short readable summary
  device-agent probe --device cpu --seconds 2
                                        benchmark the CPU only, for longer
  device-agent infer --model model.onnx digit.pgm batch.npy
                                        classify with an exported model (needs no torch)
"""


def _positive_seconds(text: str) -> float:
    """argparse type: a finite budget above zero, so the benchmark always terminates."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The full parser, separate from ``main`` so its help can be tested and documented."""
    from device_agent.cli import emulate, run, worker

    parser = argparse.ArgumentParser(
        prog="device-agent",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"device-agent {__version__}")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    probe = commands.add_parser(
        "probe",
        help="measure this device (memory, accelerator, fp32 matmul throughput) and print its profile",
        description=(
            "Measure this device as it is right now and print the profile the agent will send to the "
            "coordinator: host and software versions, CPU count, total and available memory, the "
            "accelerator in use and a short fp32 matmul benchmark on it. Prints JSON unless --human is given."
        ),
    )
    probe.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda", "mps"],
        default="auto",
        help="device to profile; auto prefers cuda, then mps, then cpu (default: %(default)s). "
        "Asking for a device this machine lacks is an error, not a silent fallback to the CPU.",
    )
    probe.add_argument(
        "--seconds",
        type=_positive_seconds,
        default=0.5,
        metavar="FLOAT",
        help="time budget for the matmul benchmark; at least three repeats run even if it is exceeded "
        "(default: %(default)s)",
    )
    output = probe.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the profile as JSON (the default)")
    output.add_argument(
        "--human",
        action="store_true",
        help="print a short readable summary instead of JSON",
    )
    probe.add_argument(
        "--broker",
        metavar="URL",
        help="also measure latency and throughput to this MQTT broker (mqtt://[user:pass@]host[:port] or "
        "mqtts://...) by echoing messages on a scratch topic; off by default",
    )
    probe.set_defaults(handler=_run_probe)
    doctor = commands.add_parser(
        "doctor",
        help="check this device is ready: broker, TLS, login, topics, torch, data, disk, memory",
        description=(
            "Check, one line each, everything the agent needs to join its fleet: agent.yaml and its secret files, "
            "the broker's address, its TLS certificate against the kit's CA (and this clock), the login, "
            "this device's topics, torch and the accelerator, the data, free disk and memory. A failed check "
            "prints a hint. Exit status 1 if any check failed. Run it as the agent's user (sudo)."
        ),
    )
    where = doctor.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--config", type=Path, metavar="FILE", help="agent.yaml (installed: /opt/fedfleet/etc/agent.yaml)"
    )
    where.add_argument(
        "--kit",
        type=Path,
        metavar="DIR",
        help="an unpacked kit folder, checked where it lies: its agent.yaml with the certificates and secrets "
        "of the folder and state in DIR/state",
    )
    doctor.add_argument(
        "--force",
        action="store_true",
        help="check the login even while the agent runs: the broker then disconnects the agent (one login, "
        "one connection) and it reconnects; by default that check is skipped while the agent runs",
    )
    doctor.add_argument(
        "--timeout", type=_positive_seconds, default=5.0, metavar="S", help="per network step (default: %(default)s)"
    )
    doctor.set_defaults(handler=_run_doctor)
    run.add_parser(commands)
    emulate.add_parser(commands)
    worker.add_parser(commands)
    infer.add_parser(commands)
    return parser


def format_human(profile: DeviceProfile) -> str:
    """A summary for someone at the device's console; JSON stays the machine format."""
    accelerator = profile.accelerator
    if profile.accelerator_name:
        accelerator += f" ({profile.accelerator_name}"
        if profile.accelerator_memory_bytes is not None:
            accelerator += f", {profile.accelerator_memory_bytes / _GIB:.1f} GiB"
        accelerator += ")"
    lines = [
        f"host:        {profile.hostname} ({profile.platform})",
        f"cpus:        {profile.cpu_count}",
        f"memory:      {profile.memory_total_bytes / _GIB:.1f} GiB total, "
        f"{profile.memory_available_bytes / _GIB:.1f} GiB available",
        f"accelerator: {accelerator}",
        f"matmul fp32: {profile.matmul_gflops:.1f} GFLOPS",
    ]
    if profile.compute.memory_bandwidth_gbs is not None:
        lines.append(f"memory bw:   {profile.compute.memory_bandwidth_gbs:.1f} GB/s (batch norm)")
    if profile.network is not None:
        lines.append(
            f"broker link: {profile.network.uplink_mbps:.0f} Mbit/s, {profile.network.latency_ms:.2f} ms one way"
        )
    lines.append(f"software:    python {profile.python}, torch {profile.torch}")
    return "\n".join(lines)


def _run_probe(args: argparse.Namespace) -> int:
    from device_agent.agent.probe import probe_device

    try:
        profile = probe_device(benchmark_seconds=args.seconds, device=args.device, broker_url=args.broker)
    except (ValueError, TimeoutError) as exc:
        print(f"device-agent: error: {exc}", file=sys.stderr)
        return 1
    print(format_human(profile) if args.human else profile.model_dump_json(indent=2))
    return 0


def _run_doctor(args: argparse.Namespace) -> int:
    from device_agent.cli.doctor import diagnose

    kit = args.kit is not None
    checks = diagnose(args.kit if kit else args.config, args.timeout, kit=kit, force=args.force)
    for check in checks:
        print(check.line())
    failed = [c.name for c in checks if c.ok is False]
    warned = [c.name for c in checks if c.warn and c.ok]
    note = f" (warning: {', '.join(warned)})" if warned else ""
    print(f"{len(failed)} check(s) failed: {', '.join(failed)}" if failed else f"ready: start the agent{note}")
    return 1 if failed else 0


def user_errors() -> tuple[type[BaseException], ...]:
    """What a wrong setting or a missing resource raises: reported in one line, not as a traceback."""
    from device_agent.agent.config import ConfigError
    from device_agent.agent.probe import DeviceUnavailable
    from device_agent.agent.runtime import AgentError
    from device_agent.common.schema import SecretError
    from device_agent.data.datasets import DatasetError

    return (ConfigError, AgentError, DatasetError, SecretError, DeviceUnavailable, OSError)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``device-agent`` console script; returns the process exit code.

    argparse's own exits (``--help``, ``--version``, usage errors) are turned into return codes so
    that callers and tests get an ``int`` back in every case.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["infer"]:
        return infer.main(argv[1:], prog="device-agent infer")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    if args.command is not None:
        missing = missing_packages()
        if missing:
            print(f"device-agent: error: {install_hint(args.command, missing)}", file=sys.stderr)
            return 1
        return guarded("device-agent", lambda: args.handler(args), user_errors(), debug_requested(argv))
    # No command: help rather than a guess, and a usage-error status so scripts notice.
    parser.print_help(sys.stderr)
    return 2
