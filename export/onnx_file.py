"""torch module -> one self-contained ONNX file with a dynamic batch dimension and fedfleet metadata.

Opset >= 18 uses torch's default (dynamo) exporter, which needs onnxscript; ``external_data=False``
keeps the weights inside the file (otherwise a side ``.data`` file appears). Opsets below 18 (for
older onnxruntime builds on devices) use the legacy TorchScript exporter, which is also the
fallback when onnxscript is missing or the dynamo exporter fails; the file records which one ran.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from device_agent.infer import META_PREFIX

log = logging.getLogger("fedfleet.export")

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
DEFAULT_OPSET = 18
LEGACY_MAX_OPSET = 20


def _dynamo(model: nn.Module, example: torch.Tensor, out: Path, opset: int) -> None:
    batch = torch.export.Dim("batch")
    torch.onnx.export(
        model,
        (example,),
        str(out),
        dynamo=True,
        opset_version=opset,
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        dynamic_shapes=({0: batch},),
        external_data=False,
        verbose=False,
    )


def _legacy(model: nn.Module, example: torch.Tensor, out: Path, opset: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter warns that it is deprecated, every time
        torch.onnx.export(
            model,
            (example,),
            str(out),
            dynamo=False,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )


def write_onnx(
    model: nn.Module, input_shape: tuple[int, ...], out: Path, metadata: Mapping[str, Any], opset: int = DEFAULT_OPSET
) -> str:
    """Export ``model`` (eval mode) for inputs (N, *input_shape) to ``out``; returns the exporter used.

    ``metadata`` goes into the model's ``metadata_props`` as ``fedfleet.<key>`` (JSON for non-strings).
    """
    if opset < 9 or opset > 23:
        raise ValueError(f"opset {opset} is not supported (use 18 or newer; 9-17 for old runtimes)")
    if opset < 18 and opset > LEGACY_MAX_OPSET:
        raise ValueError(f"opset {opset}: the legacy exporter emits at most {LEGACY_MAX_OPSET}")
    model = model.eval()
    example = torch.zeros(2, *input_shape)  # batch 2: a batch of 1 would be specialized away
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    exporter = "legacy"
    with torch.no_grad():
        if opset >= 18 and importlib.util.find_spec("onnxscript") is not None:
            try:
                logging.getLogger("torch.onnx").setLevel(logging.ERROR)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, not ours to fix
                    _dynamo(model, example, out, opset)
                exporter = "dynamo"
            except Exception as error:  # the exporter raises many types; the legacy one is the fallback
                log.warning("dynamo exporter failed (%s); falling back to the legacy exporter", error)
        elif opset >= 18:
            log.warning("onnxscript is not installed: using the legacy exporter (pip install onnxscript)")
        if exporter == "legacy":
            _legacy(model, example, out, min(opset, LEGACY_MAX_OPSET))
    proto = onnx.load(str(out))
    props = {**dict(metadata), "exporter": exporter}
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key = META_PREFIX + key
        entry.value = value if isinstance(value, str) else json.dumps(value)
    proto.producer_name = "fedfleet"
    onnx.save(proto, str(out))
    for side in out.parent.glob(f"{out.name}.data"):
        side.unlink()
    return exporter


def opset_of(path: Path) -> int:
    """The default-domain opset a file was written with."""
    proto = onnx.load(str(path), load_external_data=False)
    return next(entry.version for entry in proto.opset_import if entry.domain in ("", "ai.onnx"))
