"""Image classification data sets a device or a simulation trains on, as float tensors.

Sources: ``digits`` (scikit-learn's 8x8 handwritten digits, built in), ``fashion_mnist`` (Zalando's
70,000 28x28 clothing images from Debian's ``dataset-fashion-mnist`` package, or a folder of the idx
files), a CIFAR-10/100 folder (python-batch or binary version), an image folder (one subfolder per
class; decoded with Pillow, which the agent does not depend on) and an ``.npz`` file with arrays ``x`` and ``y`` (plus
``x_test``/``y_test`` if it has its own test split). Images come out (N, C, H, W) in [0, 1],
resized and converted to the model's input size and channel count.

CIFAR's python batches are pickles. They are read by a data-only decoder over the opcode stream
(``pickletools.genops``): it builds dicts, lists, strings and byte arrays and rejects anything
else, so no code named by the file is ever imported or run.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import pickletools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from device_agent.data import mapped

SPLIT_SEED = 0
TEST_FRACTION = 0.2
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm")


DIGITS_NEED_SKLEARN = (
    "the built-in 'digits' demo data needs scikit-learn, which is not installed: "
    "pip install 'fedfleet-agent[demo]' (or scikit-learn), or train on this device's own data (data.dataset, data.path)"
)


FASHION_MNIST = "fashion_mnist"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the idx files."""
FASHION_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_MISSING = (
    f"the built-in 'fashion_mnist' data is read from {FASHION_MNIST_DIR}, which is not there: "
    "apt-get install dataset-fashion-mnist (Debian/Ubuntu), or set the data path to a folder holding "
    "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte "
    "(each raw or .gz)"
)
BUILT_IN = ("digits", FASHION_MNIST)
"""Data sets named rather than found at a path (a path may still point fashion_mnist at its idx files)."""


class DatasetError(ValueError):
    """A data source that cannot be read; the message names the file and the problem."""


def source_of(name: str, path: str | Path | None) -> str:
    """What :func:`load_dataset` reads for a config's data set ``name`` and ``path``."""
    if name == "digits" or (name == FASHION_MNIST and path is None):
        return name
    if path is None:
        raise DatasetError(f"dataset {name!r} needs a path (a folder or file on this machine)")
    return str(path)


def check_source(source: str | Path) -> None:
    """Fail now, with the reason, when ``source`` can never load here (not at every round's assignment)."""
    if str(source) == "digits" and importlib.util.find_spec("sklearn") is None:
        raise DatasetError(DIGITS_NEED_SKLEARN)
    if str(source) == FASHION_MNIST and not FASHION_MNIST_DIR.is_dir():
        raise DatasetError(FASHION_MNIST_MISSING)


@dataclass(frozen=True)
class LabeledData:
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])


_LOAD_LOCK = threading.Lock()
"""Held while a data set is read and fitted: see :func:`load_dataset`."""


def load_dataset(source: str | Path, image_size: int | None = None, in_channels: int | None = None) -> LabeledData:
    """Read ``source`` ("digits", "fashion_mnist", an idx, CIFAR or image folder, or an .npz file) for the model.

    Sources without their own test split get a fixed one: 20 % of the samples, chosen with a
    fixed seed, so every run and every emulated device sees the same split.

    One load at a time per process: a worker's devices all ask at the start of round 1, and
    ``lru_cache`` lets concurrent misses each decode their own copy (20 Fashion-MNIST devices held
    6.2 GB at once, then 1.7 GB); behind the lock the first decodes and the others hit the cache.
    What is cached is the set as fitted to the model: resizing Fashion-MNIST's 70,000 images once per
    device was most of a 300-device worker's first round, and the raw 28x28 copy (220 MB) is not kept.
    A file is read again once rewritten, a folder once its entries change (modification time is in the key).
    With ``FEDFLEET_DATA_CACHE`` set, the processes of a host map one copy (:mod:`device_agent.data.mapped`).
    """
    check_source(source)  # before the cache: a built-in set removed since it was cached is still an error
    path = Path(source)
    changed = path.stat().st_mtime_ns if path.exists() else None
    with _LOAD_LOCK:
        return _load(source, image_size, in_channels, changed)


_TENSORS = ("train_x", "train_y", "test_x", "test_y")
"""The tensors of a :class:`LabeledData`, as the data cache stores them."""


@functools.lru_cache(maxsize=2)
def _load(source: str | Path, image_size: int | None, in_channels: int | None, changed: int | None) -> LabeledData:
    folder = mapped.cache_folder()
    if folder is None:
        return _read_fitted(source, image_size, in_channels)

    def build() -> mapped.Built:
        data = _read_fitted(source, image_size, in_channels)
        tensors = {name: getattr(data, name) for name in _TENSORS}
        return tensors, {"num_classes": data.num_classes}

    where = str(Path(source).resolve()) if Path(source).exists() else str(source)
    key = {"source": where, "changed": changed, "image_size": image_size, "in_channels": in_channels}
    tensors, meta = mapped.load_or_build(folder, key, build)
    return LabeledData(**tensors, num_classes=int(meta["num_classes"]))


def _read_fitted(source: str | Path, image_size: int | None, in_channels: int | None) -> LabeledData:
    if str(source) == "digits":
        data = _digits()
    elif str(source) == FASHION_MNIST:
        check_source(FASHION_MNIST)
        data = _idx_folder(FASHION_MNIST_DIR)
    else:
        path = Path(source)
        if not path.exists():
            raise DatasetError(f"{path}: no such file or folder (and not the built-in 'digits')")
        if path.is_file():
            if path.suffix != ".npz":
                raise DatasetError(f"{path}: expected an .npz file with arrays 'x' and 'y', or a folder")
            data = _npz(path)
        elif _idx_file(path, FASHION_MNIST_FILES["train_x"]) is not None:
            data = _idx_folder(path)
        elif _cifar_files(path):
            data = _cifar(path)
        else:
            data = _image_folder(path)
    return fit_to_model(data, image_size, in_channels)


def fit_to_model(data: LabeledData, image_size: int | None, in_channels: int | None) -> LabeledData:
    def fit(x: Tensor) -> Tensor:
        if in_channels is not None and x.shape[1] != in_channels:
            if x.shape[1] == 1:
                x = x.expand(-1, in_channels, -1, -1)
            elif in_channels == 1 and x.shape[1] == 3:
                x = (x * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
            else:
                raise DatasetError(f"cannot turn {x.shape[1]}-channel images into {in_channels}-channel ones")
        if image_size is not None and x.shape[-1] != image_size:
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return x.contiguous()

    return LabeledData(fit(data.train_x), data.train_y, fit(data.test_x), data.test_y, data.num_classes)


def _from_arrays(
    x: np.ndarray, y: np.ndarray, where: str, test: tuple[np.ndarray, np.ndarray] | None = None
) -> LabeledData:
    """Validate (N, H, W[, C]) or (N, C, H, W) images with integer labels and split them."""
    images, labels = _images(x, where), _labels(y, len(x), where)
    if test is None:
        order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
        cut = round(len(labels) * TEST_FRACTION)
        if cut == 0 or cut == len(labels):
            raise DatasetError(f"{where}: {len(labels)} samples are too few for a train/test split")
        test_index, train_index = torch.from_numpy(np.sort(order[:cut])), torch.from_numpy(np.sort(order[cut:]))
        train_x, train_y = images[train_index], labels[train_index]
        test_x, test_y = images[test_index], labels[test_index]
    else:
        train_x, train_y = images, labels
        test_x, test_y = _images(test[0], where + " (test)"), _labels(test[1], len(test[0]), where + " (test)")
        if test_x.shape[1:] != train_x.shape[1:]:
            shapes = f"{tuple(test_x.shape[1:])} vs {tuple(train_x.shape[1:])}"
            raise DatasetError(f"{where}: test and train images differ in shape ({shapes})")
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    return LabeledData(train_x, train_y, test_x, test_y, num_classes)


def _images(x: np.ndarray, where: str) -> Tensor:
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4 or x.shape[1] not in (1, 3) or x.shape[2] != x.shape[3]:
        raise DatasetError(f"{where}: expected square images (N, H, W), (N, C, H, W) or (N, H, W, C), got {x.shape}")
    if x.dtype == np.uint8:
        return torch.from_numpy(x.astype(np.float32) / 255.0)
    if not np.issubdtype(x.dtype, np.floating):
        raise DatasetError(f"{where}: images must be uint8 (0-255) or float (0-1), got {x.dtype}")
    if not np.isfinite(x).all():
        raise DatasetError(f"{where}: images contain NaN or infinite values")
    return torch.from_numpy(x.astype(np.float32))


def _labels(y: np.ndarray, count: int, where: str) -> Tensor:
    y = np.asarray(y)
    if y.ndim != 1 or len(y) != count:
        raise DatasetError(f"{where}: expected {count} labels in a 1-D array, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{where}: labels must be integers, got {y.dtype}")
    if len(y) and y.min() < 0:
        raise DatasetError(f"{where}: labels must be >= 0, got {int(y.min())}")
    return torch.from_numpy(y.astype(np.int64))


@functools.lru_cache(maxsize=1)
def _digits() -> LabeledData:
    """Read once per process: a worker's hundreds of devices each ask at round 1 (17 ms of parsing each)."""
    file = digits_file()
    if file is not None:
        table = np.loadtxt(file, delimiter=",")
        x, y = table[:, :-1], table[:, -1].astype(np.int64)
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise DatasetError(DIGITS_NEED_SKLEARN) from None
        x, y = load_digits(return_X_y=True)
    return _from_arrays((x / 16.0).reshape(-1, 8, 8).astype(np.float32), y, "digits")


def digits_file() -> Path | None:
    """The digits table scikit-learn ships (64 pixel columns, then the label), found without importing it.

    Importing scikit-learn imports SciPy: ~100 MiB per process that only wants 1,797 rows, paid by every
    emulation worker and the coordinator. None where scikit-learn is absent or keeps the file elsewhere.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return file if file.is_file() else None


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _idx_folder(folder: Path) -> LabeledData:
    """The four MNIST-style idx files of ``folder`` (raw or gzipped), decoded (once per process: see load_dataset)."""
    arrays = {}
    for key, stem in FASHION_MNIST_FILES.items():
        file = _idx_file(folder, stem)
        if file is None:
            raise DatasetError(f"{folder}: {stem} (or {stem}.gz) is missing; an idx data set needs all four files")
        arrays[key] = read_idx(file)
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DatasetError(f"{folder}: {split} images {x.shape} and labels {y.shape} do not pair up")
    train_x = (arrays["train_x"].astype(np.float32) / 255.0)[:, None]
    test_x = (arrays["test_x"].astype(np.float32) / 255.0)[:, None]
    return _from_arrays(train_x, arrays["train_y"], str(folder), (test_x, arrays["test_y"]))


_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4")}


def read_idx(file: Path) -> np.ndarray:
    """One idx array (the MNIST file format: a 4-byte magic, big-endian dimensions, then the values)."""
    try:
        raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DatasetError(f"{file}: cannot be read: {exc}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or not 1 <= raw[3] <= 4:
        raise DatasetError(f"{file}: not an idx file (magic {raw[:4].hex() or 'missing'})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetError(f"{file}: truncated idx header")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DatasetError(f"{file}: {len(raw) - header} bytes of values for shape {shape} (expected {expected})")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _npz(path: Path) -> LabeledData:
    try:
        with np.load(path, allow_pickle=False) as arrays:
            content = {key: arrays[key] for key in arrays.files}
    except (OSError, ValueError) as error:
        raise DatasetError(f"{path}: not a readable .npz file ({error})") from None
    missing = [key for key in ("x", "y") if key not in content]
    if missing:
        raise DatasetError(f"{path}: missing array(s) {', '.join(missing)}; found {', '.join(content) or 'none'}")
    test = None
    if "x_test" in content or "y_test" in content:
        if not ("x_test" in content and "y_test" in content):
            raise DatasetError(f"{path}: has only one of 'x_test' / 'y_test'")
        test = (content["x_test"], content["y_test"])
    return _from_arrays(content["x"], content["y"], str(path), test)


def _image_folder(path: Path) -> LabeledData:
    """One subfolder per class (sorted names are labels 0, 1, ...); a train/ + test/ pair keeps its split."""
    if (path / "train").is_dir() and (path / "test").is_dir():
        classes = sorted(d.name for d in (path / "train").iterdir() if d.is_dir())
        train, test = _read_classes(path / "train", classes), _read_classes(path / "test", classes)
        return _from_arrays(*train, str(path), test)
    classes = sorted(d.name for d in path.iterdir() if d.is_dir())
    return _from_arrays(*_read_classes(path, classes), str(path))


def _read_classes(root: Path, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    if not classes:
        raise DatasetError(f"{root}: no class subfolders (expected one folder of images per class)")
    try:
        from PIL import Image
    except ImportError:
        raise DatasetError(f"{root}: reading image folders needs Pillow (pip install pillow)") from None
    images, labels, size = [], [], None
    for label, name in enumerate(classes):
        files = sorted(f for f in (root / name).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        for file in files:
            try:
                with Image.open(file) as image:
                    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
            except OSError as error:
                raise DatasetError(f"{file}: not a readable image ({error})") from None
            if size is None:
                size = array.shape
            elif array.shape != size:
                raise DatasetError(f"{file}: size {array.shape[:2]} differs from the first image's {size[:2]}")
            images.append(array)
            labels.append(label)
    if not images:
        raise DatasetError(f"{root}: no images ({', '.join(IMAGE_SUFFIXES)}) in the class subfolders")
    return np.stack(images), np.asarray(labels)


def _cifar_files(path: Path) -> list[Path]:
    names = ("data_batch_1", "test_batch", "train", "test", "data_batch_1.bin", "test_batch.bin", "train.bin")
    return [path / n for n in names if (path / n).is_file()]


def _cifar(path: Path) -> LabeledData:
    """CIFAR-10 (data_batch_1..5 + test_batch) or CIFAR-100 (train + test), python or binary version."""
    if (path / "data_batch_1.bin").is_file() or (path / "train.bin").is_file():
        return _cifar_binary(path)
    ten = (path / "data_batch_1").is_file()
    train_files = [path / f"data_batch_{i}" for i in range(1, 6)] if ten else [path / "train"]
    test_file = path / ("test_batch" if ten else "test")
    label_key = b"labels" if ten else b"fine_labels"
    parts = [_cifar_batch(f, label_key) for f in [*train_files, test_file]]
    train_x = np.concatenate([p[0] for p in parts[:-1]])
    train_y = np.concatenate([p[1] for p in parts[:-1]])
    return _from_arrays(train_x, train_y, str(path), parts[-1])


def _cifar_batch(file: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    if not file.is_file():
        raise DatasetError(f"{file}: missing CIFAR batch")
    batch = decode_data_pickle(file.read_bytes(), str(file))
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise DatasetError(f"{file}: not a CIFAR batch (expected keys 'data' and {label_key.decode()!r})")
    data, labels = batch[b"data"], np.asarray(batch[label_key])
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3072 or data.dtype != np.uint8:
        raise DatasetError(f"{file}: 'data' must be a uint8 array of shape (N, 3072)")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_binary(path: Path) -> LabeledData:
    ten = (path / "data_batch_1.bin").is_file()
    train_files = [path / f"data_batch_{i}.bin" for i in range(1, 6)] if ten else [path / "train.bin"]
    test_file = path / ("test_batch.bin" if ten else "test.bin")
    label_bytes = 1 if ten else 2
    parts = []
    for file in [*train_files, test_file]:
        if not file.is_file():
            raise DatasetError(f"{file}: missing CIFAR batch")
        raw = np.fromfile(file, dtype=np.uint8)
        record = label_bytes + 3072
        if len(raw) % record:
            raise DatasetError(f"{file}: size {len(raw)} is not a multiple of the {record}-byte CIFAR record")
        rows = raw.reshape(-1, record)
        parts.append((rows[:, label_bytes:].reshape(-1, 3, 32, 32), rows[:, label_bytes - 1].astype(np.int64)))
    train_x = np.concatenate([p[0] for p in parts[:-1]])
    train_y = np.concatenate([p[1] for p in parts[:-1]])
    return _from_arrays(train_x, train_y, str(path), parts[-1])


_NUMPY_GLOBALS = {
    "numpy.core.multiarray _reconstruct",
    "numpy._core.multiarray _reconstruct",
    "numpy ndarray",
    "numpy dtype",
    "_codecs encode",
    "numpy.core.numeric _frombuffer",
    "numpy._core.numeric _frombuffer",
}


class _Global:
    def __init__(self, name: str) -> None:
        self.name = name


class _Call:
    """A REDUCE of an allowed numpy global, resolved when BUILD gives it its state."""

    def __init__(self, target: _Global, args: tuple) -> None:
        self.target, self.args = target, args
        self.value: Any = None


def decode_data_pickle(payload: bytes, where: str = "pickle") -> Any:
    """Decode a pickle holding only dicts, lists, tuples, strings, numbers and numpy arrays.

    A stack machine over the opcode stream that constructs nothing but those: globals other
    than numpy's array reconstruction are refused, and even those are rebuilt here from raw
    bytes, never called.
    """
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(payload):
            name = opcode.name
            if name in ("PROTO", "FRAME", "STOP"):
                if name == "STOP":
                    return _resolve(stack.pop())
            elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE"):
                stack.append({"EMPTY_DICT": {}, "EMPTY_LIST": [], "EMPTY_TUPLE": ()}[name])
            elif name == "MARK":
                marks.append(len(stack))
            elif name in ("SETITEMS", "APPENDS", "TUPLE", "LIST", "DICT"):
                start = marks.pop()
                items = stack[start:]
                del stack[start:]
                if name == "SETITEMS":
                    stack[-1].update(zip(items[::2], items[1::2], strict=True))
                elif name == "APPENDS":
                    stack[-1].extend(items)
                elif name == "TUPLE":
                    stack.append(tuple(items))
                elif name == "LIST":
                    stack.append(list(items))
                else:
                    stack.append(dict(zip(items[::2], items[1::2], strict=True)))
            elif name == "SETITEM":
                value, key = stack.pop(), stack.pop()
                stack[-1][key] = value
            elif name == "APPEND":
                value = stack.pop()
                stack[-1].append(value)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                size = int(name[-1])
                items = tuple(stack[-size:])
                del stack[-size:]
                stack.append(items)
            elif name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = stack[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                stack.append(memo[int(arg)])
            elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
                stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
            elif name in ("BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4", "BINFLOAT", "FLOAT"):
                stack.append(arg)
            elif name in ("SHORT_BINSTRING", "BINSTRING", "STRING", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"):
                stack.append(arg if isinstance(arg, bytes) else arg.encode("latin-1"))
            elif name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"):
                stack.append(arg)
            elif name in ("GLOBAL", "STACK_GLOBAL"):
                target = arg if name == "GLOBAL" else f"{stack.pop(-2)} {stack.pop()}"
                if target not in _NUMPY_GLOBALS:
                    raise DatasetError(f"{where}: refers to {target!r}; only data and numpy arrays are accepted")
                stack.append(_Global(target))
            elif name == "REDUCE":
                args, target = stack.pop(), stack.pop()
                if not isinstance(target, _Global):
                    raise DatasetError(f"{where}: REDUCE on something that is not an allowed numpy global")
                if target.name == "_codecs encode":  # how Python 3 writes bytes at protocol 2: text + 'latin1'
                    if len(args) != 2 or args[1] not in ("latin1", "latin-1"):
                        raise DatasetError(f"{where}: unsupported byte encoding {args[1:]!r}")
                    stack.append(str(args[0]).encode("latin-1"))
                elif target.name.endswith("_frombuffer"):  # protocol 5: (bytes, dtype, shape, order)
                    stack.append(_array(args[0], _resolve(args[1]), args[2], args[3] == "F", where))
                else:
                    stack.append(_Call(target, args))
            elif name == "BUILD":
                state = stack.pop()
                _build(stack[-1], state, where)
            else:
                raise DatasetError(f"{where}: unsupported pickle opcode {name}; only plain data is accepted")
    except (IndexError, KeyError, TypeError, ValueError) as error:
        if isinstance(error, DatasetError):
            raise
        raise DatasetError(f"{where}: not a well-formed data pickle ({error})") from None
    raise DatasetError(f"{where}: pickle stream has no STOP")


def _build(call: Any, state: Any, where: str) -> None:
    if not isinstance(call, _Call):
        raise DatasetError(f"{where}: BUILD on something that is not a numpy object")
    if call.target.name.endswith("dtype"):
        call.value = np.dtype(_text(call.args[0]))
        if len(state) > 1 and state[1] in ("<", ">"):
            call.value = call.value.newbyteorder(state[1])
        return
    _version, shape, dtype, fortran, raw = state
    call.value = _array(raw, _resolve(dtype), shape, bool(fortran), where)


def _array(raw: Any, dtype: Any, shape: Any, fortran: bool, where: str) -> np.ndarray:
    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise DatasetError(f"{where}: array with unsupported dtype {dtype!r}")
    data = raw if isinstance(raw, bytes) else str(raw).encode("latin-1")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C").copy()


def _text(value: Any) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else str(value)


def _resolve(value: Any) -> Any:
    if isinstance(value, _Call):
        return value.value
    if isinstance(value, dict):
        return {_resolve(k): _resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v) for v in value)
    return value
