import gzip
from pathlib import Path

import numpy as np
import pytest

from device_agent.data import datasets
from device_agent.data.datasets import DatasetError, check_source, load_dataset
from device_agent.data.idx import DEBIAN_DIR, FILES, IdxError, available, read_idx
from device_agent.data.partition import PartitionSpec, client_shard


def write_idx(path: Path, array: np.ndarray, compress: bool, magic: int | None = None) -> None:
    magic = magic if magic is not None else 0x800 | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw))
    else:
        path.write_bytes(raw)


def write_fashion(folder: Path, compress: bool, train: int = 40, test: int = 10) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        write_idx(folder / FILES[f"{split}_x"], rng.integers(0, 256, (count, 28, 28)), compress)
        write_idx(folder / FILES[f"{split}_y"], np.arange(count) % 10, compress)


@pytest.mark.parametrize("compress", [True, False], ids=["gz", "raw"])
def test_a_folder_of_idx_files_loads_with_its_own_split(tmp_path, compress):
    write_fashion(tmp_path / "fm", compress)
    data = load_dataset(tmp_path / "fm")
    assert data.train_x.shape == (40, 1, 28, 28) and data.test_x.shape == (10, 1, 28, 28)
    assert data.num_classes == 10 and data.train_y[:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert float(data.train_x.max()) <= 1.0 and float(data.train_x.min()) >= 0.0


def test_fashion_mnist_shards_like_digits(tmp_path):
    write_fashion(tmp_path / "fm", compress=True, train=100)
    data = load_dataset(tmp_path / "fm", image_size=14)
    spec = PartitionSpec("dirichlet", num_clients=5, seed=1, alpha=0.5)
    sizes = [len(client_shard(data.train_x, data.train_y, spec, c)[1]) for c in range(5)]
    assert sum(sizes) == 100 and data.train_x.shape[-1] == 14


def test_bad_magic_is_named(tmp_path):
    write_idx(tmp_path / "x", np.zeros((2, 3, 3)), compress=False, magic=0x0803_0000)
    with pytest.raises(IdxError, match="bad magic number 0x08030000"):
        read_idx(tmp_path / "x")


def test_truncated_file_is_named(tmp_path):
    write_idx(tmp_path / "x", np.zeros((2, 3, 3)), compress=False)
    (tmp_path / "x").write_bytes((tmp_path / "x").read_bytes()[:-1])
    with pytest.raises(IdxError, match="needs 34"):
        read_idx(tmp_path / "x")


def test_missing_package_names_the_apt_package(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "DEBIAN_DIR", tmp_path / "absent")
    with pytest.raises(DatasetError, match="apt-get install dataset-fashion-mnist"):
        check_source("fashion_mnist")
    with pytest.raises(DatasetError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion_mnist")


@pytest.mark.skipif(not available(DEBIAN_DIR), reason="needs apt-get install dataset-fashion-mnist")
def test_the_debian_package_holds_60000_training_images():
    data = load_dataset("fashion_mnist")
    assert data.train_x.shape == (60_000, 1, 28, 28) and len(data.test_y) == 10_000 and data.num_classes == 10


def test_agent_config_takes_fashion_mnist_without_a_path():
    from device_agent.config import DataConfig

    assert DataConfig(dataset="fashion_mnist").source == "fashion_mnist"
    assert DataConfig(dataset="fashion_mnist", path="/data/fm").source == "/data/fm"
