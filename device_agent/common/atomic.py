"""Crash-safe file writes shared by the agent's outbox and the coordinator's run directory.

A reader must only ever see the old file or the complete new one, even if the writer is killed or
the machine loses power mid-write. So every write goes to a temporary file in the same directory
(same file system, so the rename is atomic), is fsynced, renamed over the target, and the directory
is fsynced so the rename itself survives a power cut. Appends (journals) fsync each line; a reader
treats a final line without its newline as never written.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TEMP_PREFIX = ".tmp-"


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable (POSIX needs the directory fsynced too)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | str, mode: int | None = None, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``data`` so that no crash can leave a partial file behind.

    ``mode`` is set on the temporary file before anything is written, so a secret is never readable
    by others in between; ``owner`` (uid, gid) hands it to another user (mosquitto drops root).
    """
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    temp = path.with_name(f"{TEMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if owner is not None:
            os.chown(temp, *owner)
        os.replace(temp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise _naming(exc, path) from None
    fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it: once this returns, the line survives a crash."""
    if "\n" in line:
        raise ValueError("a journal line must not contain a newline")
    path = Path(path)
    new = not path.exists()
    try:
        with open(path, "ab") as f:
            f.write(line.encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _naming(exc, path) from None
    if new:
        fsync_dir(path.parent)


def _naming(exc: BaseException, path: Path) -> BaseException:
    """``exc`` with the file it failed on: a failed write (ENOSPC) often carries no file name, and a
    message saying which file could not be written is the one a person can act on."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
        return OSError(exc.errno, exc.strerror, str(path))
    return exc


def remove_temp_files(directory: Path) -> list[Path]:
    """Delete what killed writers left behind; returns the removed paths."""
    removed = []
    for temp in Path(directory).glob(f"{TEMP_PREFIX}*"):
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
            removed.append(temp)
    return removed
