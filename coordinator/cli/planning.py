"""``coordinator profiles | validate | plan``: the device catalog, fleet.yaml checks and the rank plan."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from coordinator.cli.readiness import start_problems
from coordinator.config.fleet import Device, Fleet, FleetError, load_fleet
from coordinator.planning.planner import fmt_bytes, plan_fleet
from profiles.catalog import ENV_VAR, ProfileError, load_catalog


def add_profiles_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "profiles",
        help="list the device profiles planning knows (shipped + your own)",
        description=(
            "List device-class profiles: memory (and whether the OS shares it), fp32 throughput, memory "
            f"bandwidth and network link. Shipped profiles come first; directories in ${ENV_VAR} "
            "(os.pathsep-separated) and --dir add or replace profiles of the same name. Estimated numbers "
            "are marked with *."
        ),
    )
    parser.add_argument("--dir", type=Path, action="append", default=[], help="extra profile directory (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the profiles as a JSON list")
    parser.set_defaults(handler=_profiles)


def add_validate_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "validate",
        help="check a fleet.yaml and say exactly what is wrong",
        description="Validate a fleet.yaml; every problem is printed with its key path, e.g. devices[3].profile.",
        epilog="example: coordinator validate --fleet examples/fleet.yaml",
    )
    parser.add_argument("--fleet", type=Path, required=True, help="path to fleet.yaml")
    parser.set_defaults(handler=_validate)


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="the level each device will train, or why it is excluded",
        description=(
            "For each device of a fleet.yaml, the largest allowed ratio whose predicted peak training "
            "memory fits the device's budget (usable memory / planning.memory_safety_factor) and whose "
            "predicted round time (local training + model download + update upload) fits round_deadline_s. "
            "A ratio means what the strategy makes of it: a FedHM rank ratio gamma, a HeteroFL/FedRolex "
            "width, or nothing for strategies that train the whole model everywhere; every prediction uses "
            "the model the strategy really sends at that level. Devices that fit no ratio are excluded with "
            "the reason. Predictions use the device profiles."
        ),
        epilog="example: coordinator plan --fleet examples/fleet.yaml --json",
    )
    parser.add_argument("--fleet", type=Path, required=True, help="path to fleet.yaml")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of {device, profile, ratio, model, trainable_params, est_memory_bytes, "
        "memory_budget_bytes, est_round_seconds, deadline_seconds, reason, samples, batch_size, local_epochs}",
    )
    parser.set_defaults(handler=_plan)


def _sized(fleet: Fleet, device: Device) -> dict[str, int]:
    """What the plan sized ``device`` at: the samples, batch and epochs its kit and assignments carry to it."""
    train = fleet.training.for_device(device, seed=0)
    return {"samples": fleet.samples_for(device), "batch_size": train.batch_size, "local_epochs": train.epochs}


def _profiles(args: argparse.Namespace) -> int:
    try:
        catalog = load_catalog(args.dir)
    except ProfileError as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([catalog[name].model_dump(mode="json") for name in sorted(catalog)], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(catalog)} device profiles (* = estimate)")
    for column, justify in (
        ("name", "left"),
        ("accelerator", "left"),
        ("memory", "right"),
        ("usable", "right"),
        ("fp32 GFLOPS", "right"),
        ("mem GB/s", "right"),
        ("link up/down Mbit/s", "right"),
    ):
        table.add_column(column, justify=justify, no_wrap=column == "name")  # type: ignore[arg-type]
    for name in sorted(catalog):
        p = catalog[name]
        est = set(p.estimated_fields)

        def mark(field: str, text: str, est: set[str] = est) -> str:
            return text + ("*" if field in est else "")

        bandwidth = p.compute.memory_bandwidth_gbs
        table.add_row(
            name,
            p.accelerator,
            mark("memory.total", fmt_bytes(p.memory.total)) + (" shared" if p.memory.shared else ""),
            mark("memory.reserved", fmt_bytes(p.memory.usable_bytes)),
            mark("compute.fp32_gflops", f"{p.compute.fp32_gflops:g}"),
            mark("compute.memory_bandwidth_gbs", "?" if bandwidth is None else f"{bandwidth:g}"),
            mark("network.uplink_mbps", f"{p.network.uplink_mbps:g}/{p.network.downlink_mbps:g}"),
        )
    Console().print(table)
    return 0


def _validate(args: argparse.Namespace) -> int:
    try:
        fleet, _ = load_fleet(args.fleet)
    except FleetError as exc:
        print(f"coordinator: invalid fleet: {exc}", file=sys.stderr)
        return 1
    problems = start_problems(fleet)
    if problems:
        print(f"coordinator: {args.fleet} is valid but cannot start here:", file=sys.stderr)
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"{args.fleet}: ok (fleet {fleet.fleet!r}, {len(fleet.devices)} devices, strategy {fleet.strategy.name})")
    return 0


def _plan(args: argparse.Namespace) -> int:
    try:
        fleet, catalog = load_fleet(args.fleet)
    except FleetError as exc:
        print(f"coordinator: invalid fleet: {exc}", file=sys.stderr)
        return 1
    rows = plan_fleet(fleet, catalog)
    if args.json:
        sizes = {device.id: _sized(fleet, device) for device in fleet.devices}
        print(json.dumps([row.as_dict() | sizes[row.device] for row in rows], indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{fleet.fleet}: {fleet.strategy.name} on {fleet.model.arch}, batch {fleet.training.batch_size}, "
        f"deadline {fleet.round_deadline_s:g} s"
    )
    for column in ("device", "profile", "model", "params", "memory / budget", "round", "reason"):
        table.add_column(column, justify="right" if column in {"params", "round"} else "left")
    for row in rows:
        memory = (
            "-"
            if row.est_memory_bytes is None
            else f"{fmt_bytes(row.est_memory_bytes)} / {fmt_bytes(row.memory_budget_bytes or 0)}"
        )
        table.add_row(
            row.device,
            row.profile,
            "excluded" if row.ratio is None else row.model,
            "-" if row.ratio is None or row.trainable_params is None else f"{row.trainable_params / 1e6:.2f} M",
            memory,
            "-" if row.est_round_seconds is None else f"{row.est_round_seconds:.0f} s",
            row.reason,
        )
    Console().print(table)
    planned = sum(row.ratio is not None for row in rows)
    print(f"{planned} of {len(rows)} devices planned")
    if fleet.privacy is not None:
        from coordinator.privacy.layer import plan_statement

        print(plan_statement(fleet.privacy, len(fleet.devices), fleet.participation, fleet.rounds))
    return 0
