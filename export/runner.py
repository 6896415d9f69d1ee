"""One export from a run, start to end: build the model, write the file, prove it, measure it, record it.

Each export appends a line to ``RUN_DIR/exports.jsonl`` (file, size, parity, latency, accuracy of
the int8 copy next to fp32), which the run report lists.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from device_agent.common.atomic import append_line
from export.check import FP32_TOLERANCE, accuracy, check_parity, latency_ms, quantize_int8
from export.onnx_file import DEFAULT_OPSET, opset_of, write_onnx
from export.records import EXPORTS_FILE
from export.targets import ExportError, Target, TrainedRun, build_target, class_names, load_run_data

PREPROCESSING = {"scale": 1 / 255, "resize": "bilinear", "layout": "NCHW"}


@dataclass
class ExportOptions:
    out: Path
    ratio: float | None = None
    merged: bool = False
    personal: str | None = None
    device_state: Path | None = None
    opset: int = DEFAULT_OPSET
    quantize: bool = False
    parity_samples: int = 64
    tolerance: float = FP32_TOLERANCE
    latency: bool = True


@dataclass
class ExportRecord:
    """What ``exports.jsonl`` and the report say about one exported file."""

    file: str
    bytes: int
    target: str
    round: int
    exporter: str
    opset: int
    max_abs_diff: float
    top1_agreement: float
    parity_samples: int
    latency_ms_b1: float | None = None
    latency_ms_b32: float | None = None
    accuracy: float | None = None
    int8: dict[str, Any] | None = None
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))


def metadata(run: TrainedRun, target: Target) -> dict[str, Any]:
    """Everything a device needs to use the file, stored in the file."""
    channels = run.in_channels
    return {
        "run_id": run.run_id,
        "round": run.round,
        "strategy": run.strategy,
        "target": target.label,
        "ratio": "merged" if target.kind == "merged" else target.ratio,
        "personal": target.device or "",
        "arch": run.arch,
        "input_shape": [channels, run.image_size, run.image_size],
        "class_names": class_names(run.dataset, run.dataset_path, run.num_classes),
        "preprocessing": {**PREPROCESSING, "mean": [0.0] * channels, "std": [1.0] * channels},
        "dataset": run.dataset,
    }


def export_run(run: TrainedRun, options: ExportOptions) -> ExportRecord:
    """Export one model of ``run`` as asked; raises ExportError / ParityError with the reason."""
    if options.parity_samples < 1:
        raise ExportError("--parity-samples must be at least 1")
    target = build_target(
        run, ratio=options.ratio, merged=options.merged, personal=options.personal, device_state=options.device_state
    )
    data = load_run_data(run)
    shape = (run.in_channels, run.image_size, run.image_size)
    out = Path(options.out)
    exporter = write_onnx(target.model, shape, out, metadata(run, target), options.opset)
    parity = check_parity(out, target.reference, data.test_x[: options.parity_samples], options.tolerance)
    record = ExportRecord(
        file=str(out.resolve()),
        bytes=out.stat().st_size,
        target=target.label,
        round=run.round,
        exporter=exporter,
        opset=opset_of(out),
        max_abs_diff=parity.max_abs_diff,
        top1_agreement=parity.top1_agreement,
        parity_samples=parity.samples,
    )
    if options.latency:
        record.latency_ms_b1 = round(latency_ms(out, shape, 1), 3)
        record.latency_ms_b32 = round(latency_ms(out, shape, 32, repeats=5), 3)
    if options.quantize:
        record.accuracy = accuracy(out, data.test_x, data.test_y)
        int8 = out.with_name(f"{out.stem}.int8{out.suffix}")
        quantize_int8(out, int8)
        int8_accuracy = accuracy(int8, data.test_x, data.test_y)
        record.int8 = {
            "file": str(int8.resolve()),
            "bytes": int8.stat().st_size,
            "accuracy": int8_accuracy,
            "accuracy_drop": record.accuracy - int8_accuracy,
            "test_samples": len(data.test_y),
        }
        if options.latency:
            record.int8["latency_ms_b1"] = round(latency_ms(int8, shape, 1), 3)
    append_line(run.path / EXPORTS_FILE, json.dumps(asdict(record), sort_keys=True))
    return record


def describe(record: ExportRecord) -> str:
    """One readable paragraph for the terminal."""
    lines = [
        f"{record.file}: {record.target}, round {record.round}, {record.bytes / 2**20:.2f} MiB, "
        f"opset {record.opset} ({record.exporter} exporter)",
        f"  parity: max |onnxruntime - torch| = {record.max_abs_diff:.2e} on {record.parity_samples} test inputs, "
        f"top-1 agreement {record.top1_agreement:.1%}",
    ]
    if record.latency_ms_b1 is not None:
        lines.append(
            f"  onnxruntime latency: {record.latency_ms_b1:.2f} ms (batch 1), {record.latency_ms_b32:.2f} ms (batch 32)"
        )
    if record.int8 is not None and record.accuracy is not None:
        q = record.int8
        lines.append(
            f"  int8: {q['file']} ({q['bytes'] / 2**20:.2f} MiB), test accuracy {q['accuracy']:.4f} vs fp32 "
            f"{record.accuracy:.4f} (drop {q['accuracy_drop']:+.4f} on {q['test_samples']} samples)"
        )
    return "\n".join(lines)
