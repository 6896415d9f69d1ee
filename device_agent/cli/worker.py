"""``device-agent worker``: many emulated devices in this one process (see :mod:`device_agent.emulation.worker`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from device_agent.emulation.packing import add_batch_arguments

_EPILOG = """\
examples:
  device-agent worker --agents run/agents/worker-00.yaml
        serve every device listed there (a YAML list of agent.yaml paths), one compute slot

`coordinator emulate` and `device-agent emulate` write the lists and start the workers themselves when
they pack devices (--workers, --devices-per-worker); run it by hand only to debug one worker.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "worker",
        help="host many emulated devices in one process (what emulate starts when it packs devices)",
        description=(
            "Run the agent runtime once per listed agent.yaml inside this one process: each device keeps its "
            "own MQTT session, login, state directory, data share, outbox, link shaping and device-time pacing, "
            "but they share one torch runtime. Devices take turns in --slots compute slots and sleep off their "
            "device time outside them. Memory is held per device by accounting (the predicted peak of its level, "
            "and on CUDA the measured peak of each step): a round over the profile's budget fails with "
            "out_of_memory. Runs until Ctrl-C; exit status 1 if a device failed (e.g. its login was refused)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--agents", type=Path, required=True, metavar="LIST", help="YAML list of agent.yaml paths")
    parser.add_argument(
        "--slots", type=int, default=1, metavar="N", help="devices computing at once (default: %(default)s)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, metavar="N", help="torch threads of this process (default: %(default)s)"
    )
    add_batch_arguments(
        parser,
        "run the steps of devices with the same model, level and batch shape as one batched step where that "
        "measures cheaper (default on CUDA)",
        "train each device's steps one by one (default on CPU)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace) -> int:
    for flag, value in (("--slots", args.slots), ("--threads", args.threads)):
        if value < 1:
            print(f"device-agent: error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from device_agent.agent.config import ConfigError
    from device_agent.agent.runtime import AgentError
    from device_agent.emulation.worker import run_worker

    try:
        return run_worker(args.agents, args.slots, args.threads, args.batch)
    except (AgentError, ConfigError) as exc:
        print(f"device-agent: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
