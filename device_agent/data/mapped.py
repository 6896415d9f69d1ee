"""Fitted data sets kept as ``.npy`` files that every process of a host maps copy-on-write.

An emulation runs the coordinator and a few worker processes, and each fitted the whole set for
itself: Fashion-MNIST at 14x14 is 52 MiB of float tensors, held five times at 1,000 devices. Mapped
from one file, the page cache holds it once and each process's share of it (PSS) is a fifth; a
process that writes into a mapped tensor gets a private copy of that page, never the file.

Set ``FEDFLEET_DATA_CACHE`` to a folder to turn it on (``coordinator emulate`` and ``device-agent
emulate`` do, see :func:`share_fitted_sets`). The first process to need a set builds it under a file
lock while the others wait, then writes it to a temporary folder renamed into place, so a reader never
sees half an entry. The newest :data:`KEEP` entries stay; older ones are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("fedfleet.data")

CACHE_ENV = "FEDFLEET_DATA_CACHE"
KEEP = 4
"""Entries a cache folder keeps (one per data set, image size and channel count)."""
_META = "meta.json"
_FORMAT = 1

Built = tuple[dict[str, Tensor], dict[str, Any]]


def default_folder() -> Path:
    """``$XDG_CACHE_HOME/fedfleet/datasets`` (``~/.cache/...`` without it)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "fedfleet" / "datasets"


def share_fitted_sets() -> Path:
    """Turn the cache on for this process and the ones it starts (an operator's own setting wins)."""
    return Path(os.environ.setdefault(CACHE_ENV, str(default_folder())))


def cache_folder() -> Path | None:
    value = os.environ.get(CACHE_ENV)
    return Path(value) if value else None


def entry_name(key: Mapping[str, Any]) -> str:
    """A folder name for what identifies one fitted set (its source, when it changed, the size it was fitted to)."""
    text = json.dumps({"format": _FORMAT, **key}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def load_or_build(folder: Path, key: Mapping[str, Any], build: Callable[[], Built]) -> Built:
    """The tensors and metadata stored under ``key`` in ``folder``, mapped; built and stored first if missing.

    A cache that cannot be written (a read-only home, a full disk) only costs the sharing: the built set
    is returned as it is, and the reason logged once per set.
    """
    entry = folder / entry_name(key)
    built: Built | None = None
    try:
        if not (entry / _META).exists():
            folder.mkdir(parents=True, exist_ok=True)
            with _locked(folder / f"{entry.name}.lock"):
                if not (entry / _META).exists():
                    built = _build(build)
                    _write(entry, *built)
                    _prune(folder, current=entry)
        return _map(entry)
    except _BuildFailed as failed:
        raise failed.__cause__ from None  # the data set's own error (a bad file), not the cache's
    except (OSError, ValueError) as exc:
        if isinstance(exc, ValueError):  # a damaged file: the next process builds the entry again
            shutil.rmtree(entry, ignore_errors=True)
        log.warning("data cache %s unusable (%s); this process keeps its own copy of the data set", entry, exc)
        return built if built is not None else build()


class _BuildFailed(Exception):
    """``build`` raised: its error goes to the caller as it is, the set is not built a second time."""


def _build(build: Callable[[], Built]) -> Built:
    try:
        return build()
    except Exception as exc:
        raise _BuildFailed from exc


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder at a time across processes; without POSIX locks two may build, and the rename keeps one."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(entry: Path, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    scratch = entry.with_name(f".{entry.name}.{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        for name, tensor in tensors.items():
            np.save(scratch / f"{name}.npy", tensor.detach().cpu().contiguous().numpy())
        (scratch / _META).write_text(json.dumps({"tensors": sorted(tensors), **meta}))
        shutil.rmtree(entry, ignore_errors=True)  # what a crashed writer left (no meta.json: never mapped)
        os.replace(scratch, entry)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _map(entry: Path) -> Built:
    meta = json.loads((entry / _META).read_text())
    # mode "c": copy-on-write, so the tensors are writable in this process and the file never changes.
    tensors = {name: torch.from_numpy(np.load(entry / f"{name}.npy", mmap_mode="c")) for name in meta.pop("tensors")}
    os.utime(entry)  # recently used: kept by _prune
    return tensors, meta


def _prune(folder: Path, current: Path) -> None:
    entries = sorted(
        (p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and p != current),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[KEEP - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
        (folder / f"{old.name}.lock").unlink(missing_ok=True)


__all__ = ["CACHE_ENV", "KEEP", "cache_folder", "default_folder", "entry_name", "load_or_build", "share_fitted_sets"]
