"""ONNX export per FedHM rank ratio: onnxruntime latency against full rank, file size and parity.

One seeded full-rank model; each ratio's hybrid is its FedHM projection (truncated SVD of every
factorized layer), exported with ``export.onnx_file.write_onnx`` and checked against torch on real
inputs (scikit-learn digits resized to the model's input). Latency is the median of interleaved
runs (every model once per repetition, so a busy host slows all of them alike), batch 1 and 32.

    python -m benchmarks.export --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from device_agent.data.datasets import load_dataset
from device_agent.models import build_model, model_card
from export.check import check_parity, run, session
from export.onnx_file import opset_of, write_onnx
from export.targets import hybrid_from_dense, parse_ratio, ratio_text


def _latencies(
    paths: Sequence[Path], shape: tuple[int, ...], batch: int, repeats: int, threads: int | None
) -> list[float]:
    sessions = [session(p, threads) for p in paths]
    x = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    times: list[list[float]] = [[] for _ in paths]
    for _ in range(2):
        for sess in sessions:
            run(sess, x)
    for _ in range(repeats):
        for index, sess in enumerate(sessions):
            start = time.perf_counter()
            run(sess, x)
            times[index].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def bench(
    arch: str = "resnet18",
    ratios: Sequence[float] = (1.0, 0.5, 0.25, 0.125),
    image_size: int | None = None,
    repeats: int = 30,
    threads: int | None = None,
    num_classes: int = 10,
) -> dict:
    card = model_card(arch)
    size = image_size or card.image_size
    shape = (card.in_channels, size, size)
    torch.manual_seed(0)
    dense = build_model(arch, num_classes).eval()
    inputs = load_dataset("digits", size, card.in_channels).test_x[:64]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for ratio in ratios:
            state = dense.state_dict()
            model = dense if ratio == 1 else hybrid_from_dense(arch, ratio, state, num_classes, card.in_channels)
            path = Path(folder) / f"{arch}-{ratio}.onnx"
            exporter = write_onnx(model, shape, path, {"ratio": ratio})
            parity = check_parity(path, model, inputs)
            paths.append(path)
            rows.append(
                {
                    "ratio": ratio,
                    "file_bytes": path.stat().st_size,
                    "params": sum(p.numel() for p in model.parameters()),
                    "max_abs_diff": parity.max_abs_diff,
                    "top1_agreement": parity.top1_agreement,
                    "exporter": exporter,
                    "opset": opset_of(path),
                }
            )
        one = _latencies(paths, shape, 1, repeats, threads)
        many = _latencies(paths, shape, 32, max(3, repeats // 5), threads)
    for row, b1, b32 in zip(rows, one, many, strict=True):
        row["latency_ms_b1"], row["latency_ms_b32"] = round(b1, 3), round(b32, 3)
    full = next((row for row in rows if row["ratio"] == 1.0), rows[0])
    result: dict = {
        "benchmark": "export",
        "arch": arch,
        "input_shape": list(shape),
        "ort_threads": threads or "default",
        "repeats": repeats,
        "models": rows,
        "max_abs_diff": max(row["max_abs_diff"] for row in rows),
    }
    for row in rows:
        if row is not full:
            result[f"ort_speedup_{row['ratio']}"] = round(full["latency_ms_b1"] / row["latency_ms_b1"], 2)
            result[f"ort_speedup_b32_{row['ratio']}"] = round(full["latency_ms_b32"] / row["latency_ms_b32"], 2)
    return result


def markdown(result: dict) -> str:
    """The README table."""
    full = next(row for row in result["models"] if row["ratio"] == 1.0)
    lines = [
        "| gamma | file | params | ms, batch 1 | speedup | ms, batch 32 | speedup | max abs diff | top-1 agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["models"]:
        lines.append(
            f"| {ratio_text(row['ratio'])} | {row['file_bytes'] / 2**20:.1f} MiB | {row['params'] / 1e6:.2f} M "
            f"| {row['latency_ms_b1']:.2f} | {full['latency_ms_b1'] / row['latency_ms_b1']:.2f}x "
            f"| {row['latency_ms_b32']:.1f} | {full['latency_ms_b32'] / row['latency_ms_b32']:.2f}x "
            f"| {row['max_abs_diff']:.1e} | {row['top1_agreement']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="resnet18", help="model (default: resnet18)")
    parser.add_argument("--ratios", default="1,1/2,1/4,1/8", help="rank ratios (default: 1,1/2,1/4,1/8)")
    parser.add_argument("--image-size", type=int, help="input height = width (default: the model's)")
    parser.add_argument("--repeats", type=int, default=30, help="timed batch-1 runs per model (default: 30)")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads (default: its own)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    ratios = [parse_ratio(r) for r in args.ratios.split(",")]
    if 1.0 not in ratios:
        ratios.insert(0, 1.0)
    result = bench(args.arch, ratios, args.image_size, args.repeats, args.threads)
    print(json.dumps(result) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
