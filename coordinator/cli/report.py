"""``coordinator report RUN_DIR``: rebuild a run's report.html from its files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(commands: argparse._SubParsersAction) -> None:
    report = commands.add_parser(
        "report",
        help="regenerate report.html (summary table and plots) for a run directory",
        description=(
            "Rebuild RUN_DIR/report.html and the PNG plots in RUN_DIR/plots/ (accuracy vs round, bytes per "
            "device class, rank assignment per device, round time breakdown) from the run's metrics.jsonl. "
            "Works while a run is going and long after; it reads only the run directory."
        ),
        epilog="example: coordinator report runs/demo",
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory a coordinator wrote")
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from coordinator.run.report import ReportError, write_report

    try:
        path = write_report(args.run_dir)
    except ReportError as exc:
        print(f"coordinator report: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
