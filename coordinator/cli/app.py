"""The ``coordinator`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction

from coordinator.cli import emulate, planning, provision, report, start
from coordinator.planning.model_stats import model_stats
from coordinator.run import pretrain
from coordinator.run.exporting import open_trained_run
from device_agent import __version__
from device_agent.cli.errors import DEBUG_FLAG, DEBUG_HELP
from device_agent.common.threads import favour_io_threads
from device_agent.models import MODELS
from export import cli as export_cli


def _ratios(text: str) -> list[float]:
    ratios = []
    for item in text.split(","):
        try:
            value = float(Fraction(item.strip()))
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a number (use e.g. 0.25 or 1/4)") from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"rank ratio {item.strip()} is outside (0, 1]")
        ratios.append(value)
    return ratios


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coordinator",
        description="fedfleet coordinator: plans, runs and inspects federated training on a device fleet.",
    )
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    parser.add_argument("--version", action="version", version=f"coordinator {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    models = commands.add_parser(
        "models",
        help="what each FedHM rank ratio costs a device (parameters, upload, MACs)",
        description=(
            "Print, for each rank ratio gamma, the trainable parameters, the bytes a device uploads per "
            "round (fp32 factors + full-rank layers + norm parameters) and the forward MACs per sample "
            "of the FedHM hybrid model. gamma = 1 is the plain model."
        ),
        epilog="example: coordinator models --arch resnet18 --num-classes 10 --ratios 1,1/2,1/4,1/8",
    )
    models.add_argument("--arch", choices=sorted(MODELS), default="resnet18", help="model (default: resnet18)")
    models.add_argument("--num-classes", type=_positive, default=10, help="classifier outputs (default: 10)")
    models.add_argument(
        "--ratios",
        type=_ratios,
        default=[1.0, 0.5, 0.25, 0.125],
        help="comma-separated rank ratios, decimals or fractions (default: 1,1/2,1/4,1/8)",
    )
    models.add_argument("--in-channels", type=_positive, help="input channels (default: the model's)")
    models.add_argument("--image-size", type=_positive, help="input height = width for MACs (default: the model's)")
    models.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    models.set_defaults(handler=_models)
    report.add_parser(commands)
    planning.add_profiles_parser(commands)
    planning.add_validate_parser(commands)
    planning.add_plan_parser(commands)
    provision.add_parser(commands)
    start.add_parser(commands)
    emulate.add_parser(commands)
    pretrain.add_parser(commands)
    export_cli.add_parser(commands, open_trained_run)
    return parser


def _models(args: argparse.Namespace) -> int:
    rows = [model_stats(args.arch, ratio, args.num_classes, args.in_channels, args.image_size) for ratio in args.ratios]
    if args.json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    full = model_stats(args.arch, 1.0, args.num_classes, args.in_channels, args.image_size)
    table = Table(title=f"{args.arch}, {args.num_classes} classes: FedHM hybrid models")
    for column in ("gamma", "params", "vs full", "upload / round", "MACs / sample"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{Fraction(row.ratio).limit_denominator(1000)}",
            f"{row.params / 1e6:.2f} M",
            f"{row.params / full.params:.1%}",
            f"{row.upload_bytes / 2**20:.2f} MiB",
            f"{row.macs / 1e6:.1f} M",
        )
    Console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    favour_io_threads()  # the coordinator's one network thread reads every device's frames
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a stop message tells the user to run again
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)
