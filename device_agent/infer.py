"""On-device inference with an exported model: onnxruntime and numpy only, no torch.

A model written by ``coordinator export`` carries everything needed to use it in its ONNX
metadata (``fedfleet.*`` keys): input shape, class names and preprocessing. This module reads
inputs (``.npy``, ``.npz``, binary PGM/PPM natively; PNG/JPEG/... through Pillow when it is
installed), turns them into the model's input the way the training data was made (scale to
[0, 1], channel conversion, bilinear resize as torch's ``interpolate(align_corners=False)``,
then ``(x - mean) / std``) and prints the top-k classes.

It imports no torch on purpose: a device that only runs inference installs onnxruntime and numpy
and the agent with ``--no-deps`` (``pip install onnxruntime numpy && pip install --no-deps
AGENT_WHEEL``), far smaller than the training runtime. ``pip install 'fedfleet[infer]'`` cannot do
it: an extra adds to a distribution's dependencies, and fedfleet's (the agent's) include torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

META_PREFIX = "fedfleet."
GRAY_WEIGHTS = np.array([0.299, 0.587, 0.114], dtype=np.float32)


class InferenceError(ValueError):
    """An input or model that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelInfo:
    """What the exported model says about itself (``fedfleet.*`` metadata)."""

    input_shape: tuple[int, int, int]
    class_names: list[str]
    scale: float
    mean: list[float]
    std: list[float]
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Prediction:
    """One input's top-k classes, best first."""

    source: str
    top: list[tuple[int, str, float]]
    """(class index, class name, probability)."""

    @property
    def label(self) -> int:
        return self.top[0][0]


def _decoded(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def model_info(metadata: dict[str, str], where: str = "model") -> ModelInfo:
    """Parse the ``fedfleet.*`` metadata of an exported model; an incomplete one is named."""
    meta = {k.removeprefix(META_PREFIX): _decoded(v) for k, v in metadata.items() if k.startswith(META_PREFIX)}
    missing = [k for k in ("input_shape", "class_names", "preprocessing") if k not in meta]
    if missing:
        raise InferenceError(
            f"{where} lacks fedfleet metadata ({', '.join(META_PREFIX + k for k in missing)}); "
            "was it written by `coordinator export`?"
        )
    pre = meta["preprocessing"]
    channels, height, width = (int(v) for v in meta["input_shape"])
    return ModelInfo(
        (channels, height, width),
        [str(c) for c in meta["class_names"]],
        float(pre.get("scale", 1 / 255)),
        [float(v) for v in pre.get("mean", [0.0] * channels)],
        [float(v) for v in pre.get("std", [1.0] * channels)],
        meta,
    )


def _netpbm(path: Path) -> np.ndarray:
    """Binary PGM (P5) / PPM (P6), 8-bit: what a camera pipeline or ``convert x.png x.ppm`` gives."""
    data = path.read_bytes()
    fields: list[bytes] = []
    pos = 0
    while len(fields) < 4:
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            pos = data.index(b"\n", pos) + 1
            continue
        start = pos
        while pos < len(data) and not data[pos : pos + 1].isspace():
            pos += 1
        if start == pos:
            raise InferenceError(f"{path}: truncated PGM/PPM header")
        fields.append(data[start:pos])
    magic, width, height, maxval = fields[0], int(fields[1]), int(fields[2]), int(fields[3])
    if magic not in (b"P5", b"P6") or maxval != 255:
        raise InferenceError(f"{path}: only binary 8-bit PGM (P5) / PPM (P6) are read natively")
    channels = 3 if magic == b"P6" else 1
    pixels = np.frombuffer(data, dtype=np.uint8, count=width * height * channels, offset=pos + 1)
    return pixels.reshape(height, width, channels)


def _image(path: Path) -> np.ndarray:
    if path.suffix.lower() in (".pgm", ".ppm", ".pnm"):
        return _netpbm(path)
    try:
        from PIL import Image
    except ImportError:
        raise InferenceError(
            f"{path}: reading {path.suffix} images needs Pillow (pip install pillow); "
            ".npy, .npz, .pgm and .ppm need nothing else"
        ) from None
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except OSError as error:
        raise InferenceError(f"{path}: not a readable image ({error})") from None


def read_inputs(path: str | Path) -> list[tuple[str, np.ndarray]]:
    """Images in one file as (name, array): one for an image, one per row for a batch in .npy/.npz.

    Arrays may be (H, W), (H, W, C), (C, H, W) or a batch of those; an .npz uses its ``x`` array
    (or its only one). uint8 is 0-255, floats are taken as already in [0, 1].
    """
    path = Path(path)
    if not path.is_file():
        raise InferenceError(f"{path}: no such file")
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
    elif path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as arrays:
            names = arrays.files
            key = "x" if "x" in names else names[0] if len(names) == 1 else None
            if key is None:
                raise InferenceError(f"{path}: expected an array 'x' (or a single array), found {', '.join(names)}")
            array = arrays[key]
    else:
        return [(str(path), _image(path))]
    if array.ndim == 4 or (array.ndim == 3 and array.shape[0] not in (1, 3) and array.shape[-1] not in (1, 3)):
        return [(f"{path}[{i}]", item) for i, item in enumerate(array)]
    if array.ndim not in (2, 3):
        raise InferenceError(f"{path}: expected an image or a batch of images, got an array of shape {array.shape}")
    return [(str(path), array)]


def _resize_axis(x: np.ndarray, size: int, axis: int) -> np.ndarray:
    """Bilinear resampling along one axis, as torch's interpolate(align_corners=False, antialias=False)."""
    length = x.shape[axis]
    if length == size:
        return x
    source = np.maximum((np.arange(size, dtype=np.float64) + 0.5) * (length / size) - 0.5, 0.0)
    low = np.minimum(np.floor(source).astype(np.int64), length - 1)
    high = np.minimum(low + 1, length - 1)
    weight = (source - low).astype(np.float32)
    shape = [1] * x.ndim
    shape[axis] = size
    weight = weight.reshape(shape)
    return np.take(x, low, axis=axis) * (1 - weight) + np.take(x, high, axis=axis) * weight


# Float pixels are taken as already scaled to [0, 1] (what uint8 0-255 becomes with the metadata's scale);
# a little slack for values that went through float arithmetic.
_UNIT_SLACK = 1e-3


def _check_unit_range(x: np.ndarray, where: str) -> None:
    """Refuse float pixels outside [0, 1]: the model would answer them, wrongly (raw 0-16 digits gave one class)."""
    if not np.isfinite(x).all():
        raise InferenceError(f"{where}: pixels must be finite numbers, got NaN or infinity")
    low, high = float(x.min()), float(x.max())
    if low < -_UNIT_SLACK or high > 1 + _UNIT_SLACK:
        raise InferenceError(
            f"{where}: float pixels must lie in [0, 1] (uint8 images are 0-255), got {low:g} to {high:g}; "
            "scale them first (scikit-learn's digits are 0-16: divide by 16; 0-255 floats: divide by 255 "
            "or save them as uint8)"
        )


def preprocess(image: np.ndarray, info: ModelInfo, where: str = "input") -> np.ndarray:
    """One image -> the model's (C, H, W) float32 input, made as the training data was."""
    x = np.asarray(image)
    if x.ndim == 2:
        x = x[None]
    elif x.ndim == 3 and x.shape[-1] in (1, 3) and x.shape[0] not in (1, 3):
        x = x.transpose(2, 0, 1)
    if x.ndim != 3 or x.shape[0] not in (1, 3):
        raise InferenceError(f"{where}: expected (H, W), (H, W, C) or (C, H, W) with 1 or 3 channels, got {x.shape}")
    if x.dtype == np.uint8:
        x = x.astype(np.float32) * np.float32(info.scale)
    elif np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
        _check_unit_range(x, where)
    else:
        raise InferenceError(f"{where}: pixels must be uint8 (0-255) or float (0-1), got {x.dtype}")
    channels, height, width = info.input_shape
    if x.shape[0] != channels:
        if x.shape[0] == 1:
            x = np.repeat(x, channels, axis=0)
        elif channels == 1:
            x = (x * GRAY_WEIGHTS[:, None, None]).sum(0, keepdims=True)
        else:
            raise InferenceError(f"{where}: cannot turn {x.shape[0]} channels into {channels}")
    x = _resize_axis(_resize_axis(x, height, 1), width, 2)
    mean = np.asarray(info.mean, dtype=np.float32)[:, None, None]
    std = np.asarray(info.std, dtype=np.float32)[:, None, None]
    return ((x - mean) / std).astype(np.float32)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


class Classifier:
    """An exported model in an onnxruntime session, with its preprocessing and class names."""

    def __init__(self, model: str | Path, threads: int | None = None) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise InferenceError("onnxruntime is not installed: pip install onnxruntime numpy") from None
        path = Path(model)
        if not path.is_file():
            raise InferenceError(f"{path}: no such model file")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as error:  # onnxruntime raises its own exception types for unreadable files
            raise InferenceError(f"{path}: onnxruntime cannot load it ({error})") from None
        self.info = model_info(self.session.get_modelmeta().custom_metadata_map, str(path))
        self.input_name = self.session.get_inputs()[0].name

    def logits(self, batch: np.ndarray) -> np.ndarray:
        """Raw model outputs for an already preprocessed (N, C, H, W) float32 batch."""
        return self.session.run(None, {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)})[0]

    def predict(self, images: Sequence[tuple[str, np.ndarray]], k: int = 5, batch_size: int = 32) -> list[Prediction]:
        """Top-k classes of each (name, image), batched."""
        out: list[Prediction] = []
        k = max(1, min(k, len(self.info.class_names)))
        for start in range(0, len(images), batch_size):
            chunk = images[start : start + batch_size]
            batch = np.stack([preprocess(image, self.info, name) for name, image in chunk])
            probabilities = _softmax(self.logits(batch))
            for (name, _), row in zip(chunk, probabilities, strict=True):
                best = np.argsort(-row, kind="stable")[:k]
                out.append(Prediction(name, [(int(i), self.info.class_names[i], float(row[i])) for i in best]))
        return out


def infer(model: str | Path, inputs: Sequence[str | Path], k: int = 5, threads: int | None = None) -> list[Prediction]:
    """Classify the images in ``inputs`` (files) with an exported model: the Python face of ``device-agent infer``."""
    classifier = Classifier(model, threads)
    images = [item for path in inputs for item in read_inputs(path)]
    return classifier.predict(images, k)


_DESCRIPTION = (
    "Run an exported ONNX model on image files (.png/.jpg/... with Pillow, .pgm/.ppm natively) or "
    "arrays (.npy, .npz with 'x'; a 4-D array is a batch) and print each input's top-k classes. "
    "Inputs: uint8 images (0-255) or float arrays already in [0, 1]; anything else is refused. "
    "Preprocessing and class names come from the model's own metadata; only onnxruntime and numpy "
    "are needed: pip install onnxruntime numpy, then the agent itself without its dependencies "
    "(pip install --no-deps AGENT_WHEEL)."
)
_EPILOG = """\
examples:
  device-agent infer --model model.onnx cat.png dog.png
  device-agent infer --model model.onnx batch.npy --top 3 --json
"""


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, type=Path, metavar="FILE", help="the exported .onnx model")
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="image, .npy or .npz files")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="classes to print per input (default: 5)")
    parser.add_argument("--threads", type=int, metavar="N", help="onnxruntime intra-op threads (default: its own)")
    parser.add_argument("--json", action="store_true", help="one JSON object per input instead of text")
    parser.set_defaults(handler=run_infer)
    return parser


def add_parser(commands: argparse._SubParsersAction) -> None:
    _configure(
        commands.add_parser(
            "infer",
            help="classify images with a model exported by `coordinator export` (onnxruntime, no torch)",
            description=_DESCRIPTION,
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def run_infer(args: argparse.Namespace) -> int:
    try:
        predictions = infer(args.model, args.inputs, args.top, args.threads)
    except (InferenceError, ImportError) as error:
        print(f"device-agent infer: error: {error}", file=sys.stderr)
        return 1
    for prediction in predictions:
        if args.json:
            top = [{"index": i, "class": name, "probability": round(p, 6)} for i, name, p in prediction.top]
            print(json.dumps({"input": prediction.source, "top": top}))
        else:
            ranked = ", ".join(f"{name} {p:.3f}" for _, name, p in prediction.top)
            print(f"{prediction.source}: {ranked}")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python -m device_agent.infer") -> int:
    """The infer command on its own parser: ``device-agent infer`` routes here before anything imports torch."""
    parser = _configure(
        argparse.ArgumentParser(
            prog=prog, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    return run_infer(args)


if __name__ == "__main__":
    sys.exit(main())
