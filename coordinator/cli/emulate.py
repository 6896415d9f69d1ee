"""``coordinator emulate``: ``coordinator start`` plus one real, profile-limited agent process per device."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from coordinator.cli.start import add_run_arguments, run_start
from coordinator.config.fleet import FleetError, load_fleet
from coordinator.emulation.capacity import host_load
from coordinator.emulation.emulator import AGENTS_DIR, Emulation, EmulatorError
from coordinator.provision import default_kits
from device_agent.data.mapped import share_fitted_sets
from device_agent.emulation.packing import PackingError, add_batch_arguments, add_packing_arguments, describe
from device_agent.emulation.profile_config import measure_host_gflops

_EPILOG = f"""\
examples:
  coordinator emulate --fleet examples/demo.yaml                    the main demo (1-2 minutes on 2 cores)
  coordinator emulate --fleet fleet.yaml --run-dir runs/try --rounds 3
  coordinator emulate --fleet fleet.yaml --device-type cuda         agents on the GPU, memory-fraction caps
  coordinator emulate --fleet big.yaml --workers 4                  many devices in 4 worker processes
                                    (their logs: RUN_DIR/{AGENTS_DIR}/workers/worker-NN.log)

Each device's agent.yaml, state and log are in RUN_DIR/{AGENTS_DIR}/<device>/. The run directory is the
same as `coordinator start`'s (metrics.jsonl, checkpoints, report.html); running the same command on it
again resumes the run. Ctrl-C stops the coordinator and every agent cleanly; an agent that crashes is
reported with the end of its log and makes the command exit with status 1.
"""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "emulate",
        help="run the whole fleet on this host: the coordinator plus one emulated agent per device",
        description=(
            "Run `coordinator start` on the fleet and, once its broker is up, one real `device-agent run` "
            "process per device of the fleet, each held to its profile (with the fleet's overrides): compute "
            "threads, a memory cap (the profile's usable memory: RLIMIT_AS on CPU, a memory fraction on CUDA), "
            "its compute pace, and its link's bandwidth and latency. The pace is device time by default: every "
            "training step lasts the seconds the cost model predicts for the profile (the planner's prediction; "
            "the agent sleeps the difference and is never sped up), so a round takes as long as on the real "
            "device on any host; --pace host-ratio stretches each step by host fp32 GFLOPS / profile GFLOPS "
            "instead (the old behaviour; wrong where the host step is launch- or memory-bound). "
            "Device i of N trains on shard i of N of the fleet's dataset (dataset.partition, dataset.seed). "
            "Past --pack-above devices the agents are packed into worker processes hosting many each "
            "(memory held by accounting instead of OS caps), so hundreds fit on one host."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(parser, min_devices_default="every device", wait_timeout=300.0)
    parser.add_argument("--threads", type=int, default=1, metavar="N", help="compute threads per agent (default: 1)")
    parser.add_argument(
        "--pace",
        choices=["device-time", "host-ratio"],
        default="device-time",
        help="device-time: each step held to the cost model's step time for the profile (default); "
        "host-ratio: each step stretched by host GFLOPS / profile GFLOPS",
    )
    parser.add_argument(
        "--host-gflops",
        type=float,
        metavar="F",
        help="with --pace host-ratio: this host's fp32 GFLOPS per agent (default: measured)",
    )
    parser.add_argument(
        "--device-type", default="cpu", metavar="TYPE", help="where agents train: cpu, cuda, cuda:N (default: cpu)"
    )
    add_packing_arguments(parser)
    add_batch_arguments(
        parser,
        "workers run the training steps of their devices with the same model, level and batch shape as one "
        "batched step wherever that measures cheaper (default on CUDA workers, where steps are launch-bound)",
        "workers train each device's steps one by one (default on CPU workers, where batching measured no gain)",
    )
    parser.set_defaults(handler=_emulate)


def _emulate(args: argparse.Namespace) -> int:
    try:
        if args.host_gflops is not None and args.pace != "host-ratio":
            raise EmulatorError("--host-gflops is only used with --pace host-ratio")
        fleet, catalog = load_fleet(args.fleet)
        host_gflops = None
        if args.pace == "host-ratio":
            host_gflops = args.host_gflops or measure_host_gflops(args.threads, args.device_type)
        emulation = Emulation(
            fleet,
            catalog,
            host_gflops,
            threads=args.threads,
            device_type=args.device_type,
            workers=args.workers,
            devices_per_worker=args.devices_per_worker,
            pack_above=args.pack_above,
            batch=args.batch,
        )
    except (FleetError, EmulatorError, PackingError, ValueError) as exc:
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    pace = (
        "device time (steps held to the cost model's prediction for each profile)"
        if host_gflops is None
        else f"host ratio ({host_gflops:.1f} fp32 GFLOPS per agent here)"
    )
    if emulation.slices is None:
        steps = "each agent process trains alone"
    elif args.batch or (args.batch is None and args.device_type != "cpu"):
        steps = "workers batch the training steps of devices with the same model, level and batch shape where it "
        steps += "measures cheaper (--no-batch: one by one)"
    else:
        steps = "workers train each device's steps one by one (--batch: batched where it measures cheaper)"
    print(f"emulating {describe(len(fleet.devices), emulation.slices)}; pace: {pace}; {steps}")
    if args.device_type == "cpu":
        per_core = host_gflops if host_gflops is not None and args.threads == 1 else measure_host_gflops(1)
        load = host_load(fleet, catalog, per_core, len(os.sched_getaffinity(0)))
        if (warning := load.warning()) is not None:
            print(f"warning: {warning}", file=sys.stderr)
    # The host's cores train the emulated devices. The coordinator's own tensor work (aggregating, evaluating a
    # small model) gains little from OpenMP, whose idle workers spin between its ops: 14 % of a 2-core host at
    # 1,000 devices (perf). One thread leaves the cores to the devices.
    torch.set_num_threads(1)
    share_fitted_sets()  # the coordinator and every agent process map one copy of the data set
    args.min_devices = args.min_devices or len(fleet.devices)
    args.kits = args.kits or default_kits(args.fleet, fleet)
    emulation.kits = args.kits
    try:
        code = run_start(args, on_broker_ready=emulation.launch, plain_fallback=True)
    finally:
        crashed = emulation.stop()
    if crashed:
        print(f"{len(crashed)} emulated device(s) crashed:", file=sys.stderr)
        for exit_ in crashed:
            print(exit_.describe(), file=sys.stderr)
        return code or 1
    return code
