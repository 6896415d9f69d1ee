"""Fitted sets that the processes of one host map from one file instead of each holding a copy."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from device_agent.data import datasets, mapped
from device_agent.data.mapped import CACHE_ENV, KEEP, load_or_build, share_fitted_sets

ROOT = Path(__file__).resolve().parents[3]


def _npz(path: Path, images: int = 50) -> Path:
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (images, 8, 8), dtype=np.uint8), y=rng.integers(0, 4, images))
    return path


def _load_fresh(source: Path, image_size: int = 12) -> datasets.LabeledData:
    datasets._load.cache_clear()  # a new process: nothing fitted in memory yet
    return datasets.load_dataset(source, image_size=image_size, in_channels=1)


def test_a_fitted_set_is_built_once_and_then_mapped_copy_on_write(tmp_path, monkeypatch):
    source = _npz(tmp_path / "set.npz")
    monkeypatch.delenv(CACHE_ENV, raising=False)
    private = _load_fresh(source)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    built = _load_fresh(source)
    monkeypatch.setattr(datasets, "_read_fitted", lambda *a: pytest.fail("a cached set was fitted again"))
    shared = _load_fresh(source)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(shared, name), getattr(private, name))
        assert torch.equal(getattr(built, name), getattr(private, name))
    assert shared.num_classes == private.num_classes and shared.train_x.shape[-1] == 12
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1
    assert _mapped_file(shared.train_x).parent.parent == tmp_path / "cache"
    # Writable in this process, and a write stays in it: the file (and every other process) keeps the set.
    shared.train_x[0].fill_(7.0)
    again = _load_fresh(source)
    assert torch.equal(again.train_x[0], private.train_x[0])


def test_another_process_maps_what_the_first_one_built(tmp_path, monkeypatch):
    source = _npz(tmp_path / "set.npz")
    cache = tmp_path / "cache"
    child = (
        "import sys; from device_agent.data.datasets import load_dataset; "
        "d = load_dataset(sys.argv[1], image_size=12, in_channels=1); print(float(d.train_x.sum()))"
    )
    env = {**os.environ, CACHE_ENV: str(cache), "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-c", child, str(source)], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    monkeypatch.setenv(CACHE_ENV, str(cache))
    unused = "the set the other process built was not used"
    monkeypatch.setattr(datasets, "_read_fitted", lambda *a: pytest.fail(unused))
    data = _load_fresh(source)
    assert float(data.train_x.sum()) == pytest.approx(float(first.stdout))
    assert _mapped_file(data.train_x).name == "train_x.npy"  # the file's pages, not a copy in this process


def _mapped_file(tensor: torch.Tensor) -> Path:
    """The file whose mapping holds ``tensor``'s data (Linux: /proc/self/maps)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(bound, 16) for bound in fields[0].split("-"))
        if low <= address < high:
            return Path(fields[5] if len(fields) == 6 else "")
    raise AssertionError("the tensor is in no mapping")


def test_a_half_written_or_damaged_entry_is_built_again(tmp_path):
    key = {"source": "s", "changed": 1}
    calls = []

    def build():
        calls.append(1)
        return {"x": torch.arange(6.0).view(2, 3)}, {"num_classes": 3}

    entry = tmp_path / mapped.entry_name(key)
    entry.mkdir()
    (entry / "x.npy").write_bytes(b"half of a file")  # a writer that crashed before its meta.json
    tensors, meta = load_or_build(tmp_path, key, build)
    assert torch.equal(tensors["x"], torch.arange(6.0).view(2, 3)) and meta == {"num_classes": 3} and len(calls) == 1
    (entry / "x.npy").write_bytes(b"not an npy file")  # damaged after it was complete
    tensors, _ = load_or_build(tmp_path, key, build)
    assert torch.equal(tensors["x"], torch.arange(6.0).view(2, 3)) and len(calls) == 2
    load_or_build(tmp_path, key, build)
    assert len(calls) == 3 and (entry / "meta.json").exists()  # the damaged entry was removed, then rebuilt


def test_a_cache_that_cannot_be_written_only_costs_the_sharing(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    tensors, _ = load_or_build(blocker / "cache", {"k": 1}, lambda: ({"x": torch.ones(2)}, {}))
    assert torch.equal(tensors["x"], torch.ones(2))
    assert "keeps its own copy" in caplog.text


def test_the_newest_entries_are_kept(tmp_path):
    for number in range(KEEP + 3):
        load_or_build(tmp_path, {"n": number}, lambda n=number: ({"x": torch.full((2,), float(n))}, {}))
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(kept) == KEEP
    assert mapped.entry_name({"n": KEEP + 2}) in kept and mapped.entry_name({"n": 0}) not in kept


def test_emulation_turns_sharing_on_unless_the_operator_chose_a_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert share_fitted_sets() == tmp_path / "fedfleet" / "datasets" == Path(os.environ[CACHE_ENV])
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert share_fitted_sets() == tmp_path / "mine"


def test_a_set_that_cannot_be_read_fails_once_with_its_own_error(tmp_path, caplog):
    calls = []

    def build():
        calls.append(1)
        raise datasets.DatasetError("set.npz: expected arrays 'x' and 'y'")

    with pytest.raises(datasets.DatasetError, match="expected arrays"):
        load_or_build(tmp_path, {"k": 1}, build)
    assert len(calls) == 1 and "unusable" not in caplog.text  # not blamed on the cache, not read twice
