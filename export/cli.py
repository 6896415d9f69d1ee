"""``coordinator export``: a run's model as one ONNX file a device can run without torch.

The coordinator registers this command and passes ``open_run``, which reads its run directory
into a :class:`~export.targets.TrainedRun` (export never imports the coordinator).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from export.targets import ExportError, TrainedRun, parse_ratio

OpenRun = Callable[[Path, int | None, Path | None], TrainedRun]

_EPILOG = """\
examples:
  coordinator export runs/demo --merged --out global.onnx
  coordinator export runs/demo --ratio 1/4 --out pi4.onnx --quantize
  coordinator export runs/ffl --personal pi5-01 --out pi5-01.onnx
  coordinator export runs/lab --round 20 --ratio 0.5 --opset 17 --out old-runtime.onnx
  coordinator export runs/lab --merged --data ~/cifar-10-batches-py --out lab.onnx   (data moved or run copied)

Each file is checked before the command succeeds: onnx checker, an onnxruntime session, and
max |onnxruntime - torch| on real test inputs of the run's data set (fails above 1e-4) with the
top-1 agreement. --quantize also writes NAME.int8.onnx and reports its test accuracy next to
fp32. Every export is recorded in RUN_DIR/exports.jsonl and listed in the run report.
Run it on a device with: device-agent infer --model FILE IMAGE...
"""


def _ratio(text: str) -> float:
    try:
        return parse_ratio(text)
    except ExportError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(commands: argparse._SubParsersAction, open_run: OpenRun) -> None:
    parser = commands.add_parser(
        "export",
        help="write a run's model as one ONNX file (merged, one rank ratio, or a device's own), checked",
        description=(
            "Export a trained model of RUN_DIR to one self-contained ONNX file with a dynamic batch "
            "dimension and metadata (run, round, strategy, ratio, input shape, class names, "
            "preprocessing), so a device needs nothing else: --merged is the global model at full rank, "
            "--ratio G the FedHM hybrid (factorized) network of rank ratio G, the fast one for weak "
            "devices, and --personal DEVICE that device's personalized model (personalized strategies)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory a coordinator wrote")
    parser.add_argument("--round", type=int, metavar="N", help="the round's model (default: the last completed)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--merged", action="store_true", help="the global model, merged to full rank")
    which.add_argument("--ratio", type=_ratio, metavar="G", help="the hybrid network of rank ratio G (e.g. 1/4)")
    which.add_argument("--personal", metavar="DEVICE", help="DEVICE's personalized model")
    parser.add_argument(
        "--device-state",
        type=Path,
        metavar="FILE",
        help="with --personal: the device's kept state (state_dir/kept/RUN.kept.safetensors) for strategies "
        "that keep part of the model on the device (default: the emulated agent's, if the run has it)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="the run's data set where it lies on this machine (default: dataset.path of the run's fleet.yaml; "
        "digits and fashion_mnist are built in): parity, accuracy and class names are read from it",
    )
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="the .onnx file to write")
    parser.add_argument(
        "--opset", type=int, default=18, metavar="N", help="ONNX opset (default: 18; below 18 uses the legacy exporter)"
    )
    parser.add_argument("--quantize", action="store_true", help="also write an int8 (dynamic) copy, with its accuracy")
    parser.add_argument(
        "--parity-samples", type=int, default=64, metavar="N", help="test inputs compared with torch (default: 64)"
    )
    parser.add_argument("--no-latency", action="store_true", help="skip the onnxruntime latency measurement")
    parser.set_defaults(handler=lambda args: run_export(args, open_run))


def run_export(args: argparse.Namespace, open_run: OpenRun) -> int:
    from export.check import ParityError
    from export.runner import ExportOptions, describe, export_run

    try:
        run = open_run(args.run_dir, args.round, args.data)
        record = export_run(
            run,
            ExportOptions(
                out=args.out,
                ratio=args.ratio,
                merged=args.merged,
                personal=args.personal,
                device_state=args.device_state,
                opset=args.opset,
                quantize=args.quantize,
                parity_samples=args.parity_samples,
                latency=not args.no_latency,
            ),
        )
    except ParityError as error:
        print(f"coordinator export: parity check failed: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"coordinator export: error: {error}", file=sys.stderr)
        return 2
    print(describe(record))
    return 0
