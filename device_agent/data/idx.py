"""Fashion-MNIST from its idx files (the format LeCun's MNIST introduced), gzipped or raw.

Debian's ``dataset-fashion-mnist`` package installs the four files under
``/usr/share/datasets/fashion-mnist``; any folder holding the same names (``.gz`` or not) works
too. The decoded arrays are cached per process: 60,000 images take about a second to inflate,
and a benchmark or an emulation loads them once per client otherwise.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from pathlib import Path

import numpy as np

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
APT_PACKAGE = "dataset-fashion-mnist"
FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
# Magic numbers: two zero bytes, 0x08 (unsigned byte data), then the number of dimensions.
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


class IdxError(ValueError):
    """An idx file that is missing or malformed; the message names the file (and the apt package)."""


def missing_message(folder: Path) -> str:
    return (
        f"Fashion-MNIST not found in {folder} (expected {', '.join(FILES.values())}, gzipped or raw); "
        f"install Debian's package: apt-get install {APT_PACKAGE}, or point data.path at a folder holding them"
    )


def has_idx_files(folder: Path) -> bool:
    return folder.is_dir() and _find(folder, FILES["train_x"]) is not None


def available(folder: Path = DEBIAN_DIR) -> bool:
    """Whether every file is present, so callers (benchmarks, tests) can skip with the package's name."""
    return all(_find(folder, name) is not None for name in FILES.values())


def read_fashion_mnist(folder: Path = DEBIAN_DIR) -> dict[str, np.ndarray]:
    """uint8 images (N, 28, 28) and int64 labels for the train and test splits; cached per folder."""
    return dict(_read_cached(folder.resolve() if folder.exists() else folder))


@lru_cache(maxsize=4)
def _read_cached(folder: Path) -> tuple[tuple[str, np.ndarray], ...]:
    paths = {key: _find(folder, name) for key, name in FILES.items()}
    if any(path is None for path in paths.values()):
        raise IdxError(missing_message(folder))
    arrays = {key: read_idx(path) for key, path in paths.items() if path is not None}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.ndim != 3 or labels.ndim != 1:
            raise IdxError(f"{folder}: {split} images must be 3-D and labels 1-D, got {images.shape}, {labels.shape}")
        if len(images) != len(labels):
            raise IdxError(f"{folder}: {len(images)} {split} images but {len(labels)} labels")
        arrays[f"{split}_y"] = labels.astype(np.int64)
    for array in arrays.values():
        array.setflags(write=False)
    return tuple(arrays.items())


def _find(folder: Path, name: str) -> Path | None:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """One idx file of unsigned bytes (images: magic 0x803, labels: 0x801)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as error:
        raise IdxError(f"{path}: not readable ({error})") from None
    if len(raw) < 8:
        raise IdxError(f"{path}: {len(raw)} bytes is too short for an idx header")
    magic = int.from_bytes(raw[:4], "big")
    if magic not in (IMAGES_MAGIC, LABELS_MAGIC):
        raise IdxError(f"{path}: bad magic number {magic:#010x} (expected {IMAGES_MAGIC:#x} or {LABELS_MAGIC:#x})")
    dims = magic & 0xFF
    header = 4 + 4 * dims
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        raise IdxError(f"{path}: {len(raw)} bytes, but the header {shape} needs {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
