"""Atomic writes: a reader sees the old file or the new one, never a mix, whatever happens to the writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from device_agent.common import atomic
from device_agent.common.atomic import append_line, atomic_write, remove_temp_files


def test_atomic_write_replaces_the_file(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    atomic_write(target, b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.bin"
    atomic_write(target, b"old")

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left") as failed:
        atomic_write(target, b"new" * 1000)
    assert failed.value.errno == 28 and failed.value.filename == str(target)  # names the file it could not write
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_a_writer_killed_mid_write_leaves_the_old_file_intact(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    atomic_write(target, b"old contents")
    child = textwrap.dedent(
        f"""
        import os, time
        from device_agent.common.atomic import atomic_write
        def stalled_disk(fd):
            print("writing", flush=True)
            time.sleep(60)
        os.fsync = stalled_disk
        atomic_write({str(target)!r}, b"x" * (8 << 20))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL

    assert target.read_bytes() == b"old contents"
    (temp,) = [p for p in tmp_path.iterdir() if p.name != "state.bin"]
    assert temp.name.startswith(atomic.TEMP_PREFIX)  # the half-written new version, never renamed
    assert remove_temp_files(tmp_path) == [temp]
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]


def test_append_line_refuses_embedded_newlines(tmp_path: Path) -> None:
    append_line(tmp_path / "index.jsonl", '{"a": 1}')
    append_line(tmp_path / "index.jsonl", '{"a": 2}')
    assert (tmp_path / "index.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'
    with pytest.raises(ValueError, match="newline"):
        append_line(tmp_path / "index.jsonl", "two\nlines")
