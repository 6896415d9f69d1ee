"""Every exported file proves itself: onnx checker, an onnxruntime session, parity with torch, latency.

Parity runs the same real inputs through torch and onnxruntime, once as one batch and once a
sample at a time (so the batch dimension is shown to be dynamic), and fails above the tolerance
(1e-4 on fp32 logits; measured ~1e-7).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

FP32_TOLERANCE = 1e-4


class ParityError(AssertionError):
    """onnxruntime and torch disagree beyond the tolerance: the file must not reach a device."""


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float
    top1_agreement: float
    samples: int


def session(path: Path, threads: int | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(sess: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return sess.run(None, {sess.get_inputs()[0].name: np.ascontiguousarray(x, dtype=np.float32)})[0]


def check_parity(path: Path, model: nn.Module, inputs: torch.Tensor, tolerance: float = FP32_TOLERANCE) -> Parity:
    """onnx checker + session + max |onnxruntime - torch| and top-1 agreement on ``inputs``."""
    onnx.checker.check_model(str(path), full_check=True)
    sess = session(path)
    with torch.no_grad():
        expected = model.eval()(inputs).numpy()
    batched = run(sess, inputs.numpy())
    single = np.concatenate([run(sess, inputs[i : i + 1].numpy()) for i in range(min(4, len(inputs)))])
    diff = max(float(np.abs(batched - expected).max()), float(np.abs(single - expected[: len(single)]).max()))
    agreement = float((batched.argmax(1) == expected.argmax(1)).mean())
    if not diff <= tolerance:
        raise ParityError(f"{path}: onnxruntime differs from torch by {diff:.3g} > {tolerance:g} (max abs, logits)")
    return Parity(diff, agreement, len(inputs))


def latency_ms(
    path: Path, input_shape: tuple[int, ...], batch: int, repeats: int = 20, threads: int | None = None
) -> float:
    """Median onnxruntime wall time of one call at ``batch``, after warm-up."""
    sess = session(path, threads)
    x = np.random.default_rng(0).random((batch, *input_shape), dtype=np.float32)
    for _ in range(3):
        run(sess, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(sess, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def accuracy(path: Path, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    """Top-1 accuracy of the file in onnxruntime on a labelled set."""
    sess = session(path)
    correct = 0
    for start in range(0, len(x), batch):
        logits = run(sess, x[start : start + batch].numpy())
        correct += int((logits.argmax(1) == y[start : start + batch].numpy()).sum())
    return correct / max(1, len(x))


def quantize_int8(source: Path, target: Path) -> None:
    """onnxruntime dynamic quantization: int8 weights, activations quantized per call; metadata kept."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = target.with_name(f"{target.stem}.pre{target.suffix}")
    try:
        quant_pre_process(str(source), str(prepared))  # shape inference + graph cleanup, as onnxruntime advises
        quantize_dynamic(str(prepared), str(target), weight_type=QuantType.QInt8)
    finally:
        prepared.unlink(missing_ok=True)
    original = onnx.load(str(source))
    quantized = onnx.load(str(target))
    present = {entry.key for entry in quantized.metadata_props}
    for entry in original.metadata_props:
        if entry.key not in present:
            quantized.metadata_props.add(key=entry.key, value=entry.value)
    quantized.metadata_props.add(key="fedfleet.quantization", value="int8 dynamic (onnxruntime)")
    onnx.save(quantized, str(target))
