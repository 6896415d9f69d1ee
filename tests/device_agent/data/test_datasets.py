import gzip
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from device_agent.data import datasets
from device_agent.data.datasets import DatasetError, check_source, decode_data_pickle, load_dataset, read_idx
from tests.paths import REPO_ROOT


def test_digits_fit_to_model_input():
    data = load_dataset("digits", image_size=16, in_channels=3)
    assert data.train_x.shape[1:] == (3, 16, 16) and data.num_classes == 10
    assert len(data.train_y) + len(data.test_y) == 1797
    assert float(data.train_x.min()) >= 0 and float(data.train_x.max()) <= 1
    assert load_dataset("digits").test_y.tolist() == data.test_y.tolist()  # a fixed split


def test_digits_are_read_from_scikit_learns_file_without_importing_scikit_learn():
    """scikit-learn imports SciPy (~100 MiB a process): a worker reads the table it ships instead."""
    code = (
        "import sys; from device_agent.data.datasets import check_source, load_dataset; "
        "check_source('digits'); data = load_dataset('digits'); "
        "print(len(data.train_y) + len(data.test_y), 'sklearn' in sys.modules, 'scipy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.split() == ["1797", "False", "False"]


def test_digits_from_the_file_are_scikit_learns_load_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    table = np.loadtxt(datasets.digits_file(), delimiter=",")
    assert np.array_equal(table[:, :-1], x) and np.array_equal(table[:, -1], y)


def test_npz_with_and_without_a_test_split(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.integers(0, 255, (20, 6, 6, 3), dtype=np.uint8), y=np.arange(20) % 4)
    data = load_dataset(tmp_path / "a.npz", in_channels=1)
    assert data.train_x.shape == (16, 1, 6, 6) and data.test_x.shape == (4, 1, 6, 6) and data.num_classes == 4
    np.savez(
        tmp_path / "b.npz",
        x=rng.random((8, 5, 5), dtype=np.float32),
        y=np.arange(8) % 2,
        x_test=rng.random((3, 5, 5), dtype=np.float32),
        y_test=np.array([0, 1, 1]),
    )
    assert load_dataset(tmp_path / "b.npz").test_y.tolist() == [0, 1, 1]


def test_a_set_fitted_to_the_model_is_kept_until_its_file_changes(tmp_path):
    # a worker's hundreds of devices each ask for the same resized set: it is resized once
    np.savez(tmp_path / "a.npz", x=np.zeros((20, 6, 6), dtype=np.uint8), y=np.arange(20) % 4)
    first = load_dataset(tmp_path / "a.npz", image_size=3)
    assert load_dataset(tmp_path / "a.npz", image_size=3) is first and first.image_size == 3
    assert load_dataset(tmp_path / "a.npz").image_size == 6  # another fit is another entry
    np.savez(tmp_path / "a.npz", x=np.full((20, 6, 6), 255, dtype=np.uint8), y=np.arange(20) % 4)
    os.utime(tmp_path / "a.npz", ns=(1, 1))  # a rewrite within the clock's tick still changes the key
    assert load_dataset(tmp_path / "a.npz", image_size=3).train_x.max() == 1.0


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((4, 5, 5))}, r"missing array\(s\) y"),
        ({"x": np.zeros((4, 5, 5)), "y": np.zeros(3, dtype=int)}, "expected 4 labels"),
        ({"x": np.zeros((4, 5, 5)), "y": np.zeros(4)}, "labels must be integers"),
        ({"x": np.zeros((4, 5, 6)), "y": np.zeros(4, dtype=int)}, "expected square images"),
        ({"x": np.full((4, 5, 5), np.nan), "y": np.zeros(4, dtype=int)}, "NaN"),
    ],
)
def test_bad_npz_files_name_the_problem(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DatasetError, match=message):
        load_dataset(tmp_path / "bad.npz")


def test_missing_and_unreadable_sources(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(tmp_path / "nothing")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match=r"not a readable \.npz"):
        load_dataset(tmp_path / "junk.npz")
    with pytest.raises(DatasetError, match="no class subfolders"):
        load_dataset(tmp_path)


def test_image_folder_reads_one_class_per_subfolder(tmp_path):
    image = pytest.importorskip("PIL.Image")
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for i in range(5):
            image.fromarray(np.full((4, 4, 3), 40 * i, dtype=np.uint8)).save(tmp_path / label / f"{i}.png")
    data = load_dataset(tmp_path, image_size=8)
    assert data.num_classes == 2 and len(data.train_y) + len(data.test_y) == 10
    assert data.train_x.shape[1:] == (3, 8, 8)
    (tmp_path / "dog" / "broken.png").write_bytes(b"nope")
    with pytest.raises(DatasetError, match=r"broken.png: not a readable image"):
        load_dataset(tmp_path)


def cifar_batch_bytes(data: np.ndarray, labels: list[int]) -> bytes:
    """A CIFAR-10 python batch as Python 2 wrote it (protocol 2), assembled opcode by opcode."""

    def short(text: bytes) -> bytes:
        return b"U" + bytes([len(text)]) + text  # SHORT_BINSTRING

    raw = data.tobytes()
    dtype = (
        b"cnumpy\ndtype\n"
        + short(b"u1")
        + b"K\x00K\x01\x87R"
        + b"(K\x03"
        + short(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    )
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\n"
        + b"cnumpy\nndarray\n"
        + b"K\x00\x85"
        + short(b"b")
        + b"\x87R"
        + b"(K\x01"
        + b"K"
        + bytes([data.shape[0]])
        + b"M\x00\x0c\x86"
        + dtype
        + b"\x89"
        + b"T"
        + len(raw).to_bytes(4, "little")
        + raw
        + b"tb"
    )
    label_list = b"](" + b"".join(b"K" + bytes([v]) for v in labels) + b"e"
    return b"\x80\x02}(" + short(b"data") + array + short(b"labels") + label_list + b"u."


def test_cifar_python_batches_are_decoded_without_unpickling(tmp_path):
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 255, (2, 3072), dtype=np.uint8)
        (tmp_path / name).write_bytes(cifar_batch_bytes(data, [1, 3]))
    assert decode_data_pickle(cifar_batch_bytes(data, [1, 3]))[b"data"].tolist() == data.tolist()
    loaded = load_dataset(tmp_path)
    assert loaded.train_x.shape == (10, 3, 32, 32) and loaded.test_y.tolist() == [1, 3]
    assert np.allclose(loaded.test_x.numpy().reshape(2, -1) * 255, data)


def test_pickles_that_name_code_are_refused(tmp_path):
    evil = b"\x80\x02cos\nsystem\nU\x02lsR."
    with pytest.raises(DatasetError, match="refers to 'os system'"):
        decode_data_pickle(evil)
    (tmp_path / "data_batch_1").write_bytes(evil)
    with pytest.raises(DatasetError, match="os system"):
        load_dataset(tmp_path)


def _write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    """An MNIST-style idx file: magic (0, 0, dtype code, ndim), big-endian dimensions, then the values."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


def _idx_folder(root: Path, gz: bool, train: int = 30, test: int = 10) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir()
    _write_idx(root / "train-images-idx3-ubyte", rng.integers(0, 256, (train, 28, 28)), gz)
    _write_idx(root / "train-labels-idx1-ubyte", np.arange(train) % 10, gz)
    _write_idx(root / "t10k-images-idx3-ubyte", rng.integers(0, 256, (test, 28, 28)), gz)
    _write_idx(root / "t10k-labels-idx1-ubyte", np.arange(test) % 10, gz)
    return root


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "raw"])
def test_an_idx_folder_loads_with_its_own_test_split_in_unit_range(tmp_path: Path, gz: bool) -> None:
    folder = _idx_folder(tmp_path / "fmnist", gz)
    data = load_dataset(folder)
    assert data.train_x.shape == (30, 1, 28, 28) and data.test_x.shape == (10, 1, 28, 28)
    assert data.num_classes == 10 and data.train_y.tolist() == [i % 10 for i in range(30)]
    assert float(data.train_x.min()) >= 0.0 and float(data.train_x.max()) <= 1.0
    raw = read_idx(folder / ("train-images-idx3-ubyte" + (".gz" if gz else "")))
    assert torch.allclose(data.train_x[3, 0], torch.from_numpy(raw[3].astype(np.float32) / 255))
    assert load_dataset(folder, image_size=14, in_channels=3).train_x.shape == (30, 3, 14, 14)


def test_a_bad_idx_file_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    folder = _idx_folder(tmp_path / "fmnist", gz=False)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"\x01\x02")
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte: 2 bytes of values for shape \(5,\)"):
        load_dataset(folder)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(b"PK\x03\x04 a zip, not idx")
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte: not an idx file \(magic 504b0304\)"):
        load_dataset(folder)
    (folder / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetError, match=r"t10k-labels-idx1-ubyte \(or t10k-labels-idx1-ubyte.gz\) is missing"):
        load_dataset(folder)


def test_the_built_in_fashion_mnist_names_its_debian_package_when_missing(monkeypatch) -> None:
    monkeypatch.setattr(datasets, "FASHION_MNIST_DIR", Path("/nonexistent/fashion-mnist"))
    for call in (lambda: check_source("fashion_mnist"), lambda: load_dataset("fashion_mnist")):
        with pytest.raises(DatasetError, match="apt-get install dataset-fashion-mnist"):
            call()


@pytest.mark.skipif(not datasets.FASHION_MNIST_DIR.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_the_built_in_fashion_mnist_is_debians_70000_images() -> None:
    data = load_dataset("fashion_mnist")
    assert (len(data.train_y), len(data.test_y), data.num_classes) == (60_000, 10_000, 10)
    assert torch.bincount(data.train_y).tolist() == [6000] * 10


def test_devices_loading_at_once_decode_an_idx_folder_once_and_share_it(tmp_path: Path, monkeypatch) -> None:
    """A worker's devices all load at the start of round 1: one decode, one copy, not one per device."""
    folder = _idx_folder(tmp_path / "fmnist", gz=True)
    reads: list[Path] = []
    decode = datasets.read_idx

    def slow_read(file: Path) -> np.ndarray:
        reads.append(file)
        time.sleep(0.05)  # long enough that every thread asks before the first decode is cached
        return decode(file)

    monkeypatch.setattr(datasets, "read_idx", slow_read)
    start = threading.Barrier(8)
    loaded: list[datasets.LabeledData] = []

    def device() -> None:
        start.wait()
        loaded.append(load_dataset(folder, image_size=28, in_channels=1))

    threads = [threading.Thread(target=device) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reads) == 4  # the four idx files, once
    assert len({data.train_x.data_ptr() for data in loaded}) == 1
