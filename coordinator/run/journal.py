"""The open round's journal: every accepted upload, persisted before it is acknowledged.

``journal/round-N/`` holds one safetensors file per accepted upload and ``index.jsonl``, one line per
upload with its digest: the line is the commit point. A crash mid-write leaves a file no line
commits (removed on repair) or a torn last line (dropped); a file whose digest no longer matches
is dropped with an error, so a resumed round folds exactly the uploads that were acknowledged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from device_agent.common.atomic import append_line, atomic_write
from device_agent.wire.codec import decode_tensors
from device_agent.wire.payload import PayloadDigest

INDEX_FILE = "index.jsonl"

log = logging.getLogger("fedfleet.rundir")


class RunDirError(Exception):
    """A run directory (or its journal) that cannot be used as it is; the message names the file."""


@dataclass(frozen=True)
class JournalEntry:
    """One accepted upload of the open round, as persisted before it was acknowledged."""

    round: int
    device: str
    transfer_id: str
    digest: PayloadDigest
    """The digest the transport verified the payload against as it arrived (or its sha256, once changed)."""
    path: Path
    meta: dict[str, Any]

    def intact(self, data: bytes) -> bool:
        """Whether ``data`` still has the digest it was journaled with (read back on resume only)."""
        return self.digest.matches(data)


class RoundJournal:
    """One round's journal directory (``path``); the run directory decides which round is open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # The devices journaled and the highest file number, read from the index once, then kept as uploads
        # are appended: reading the index back for every upload made a 1,000-device round quadratic.
        self._appended: tuple[set[str], int] | None = None

    def entries(self) -> list[JournalEntry]:
        """The accepted uploads, first device entry each; a missing committed file is an error."""
        journal = self.path
        index = journal / INDEX_FILE
        if not index.exists():
            return []
        entries: list[JournalEntry] = []
        seen: set[str] = set()
        for number, line in enumerate(index.read_text().splitlines(keepends=True), start=1):
            if not line.endswith("\n"):
                break  # torn append: never committed, so never acknowledged
            try:
                raw = json.loads(line)
                entry = JournalEntry(
                    round=int(raw["round"]),
                    device=str(raw["device"]),
                    transfer_id=str(raw["transfer_id"]),
                    digest=PayloadDigest.from_record(raw),
                    path=journal / Path(raw["file"]).name,
                    meta=dict(raw.get("meta") or {}),
                )
            except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
                raise RunDirError(
                    f"{index} line {number}: not a journal entry ({type(exc).__name__}: {str(exc)[:200]})"
                ) from None
            if entry.device in seen:
                continue
            if not entry.path.is_file():
                raise RunDirError(f"{index} line {number}: {entry.path.name} is missing; an accepted upload is lost")
            seen.add(entry.device)
            entries.append(entry)
        return entries

    def accept(
        self,
        round_: int,
        device: str,
        transfer_id: str,
        data: bytes,
        meta: Mapping[str, Any] | None,
        verified: PayloadDigest | None,
    ) -> bool:
        """Append one accepted upload (its file first, then its index line: the commit point).

        ``verified``: the digest its transport already checked ``data`` against, so each received byte is
        hashed once; without one (an upload changed before journaling) ``data`` is hashed here.
        """
        journal = self.path
        if self._appended is None:
            entries = self.entries()
            # Numbered past the highest entry, not by count: a dropped corrupt entry leaves a gap.
            self._appended = {entry.device for entry in entries}, max((int(e.path.stem) for e in entries), default=0)
        devices, highest = self._appended
        if device in devices:
            return False
        journal.mkdir(parents=True, exist_ok=True)
        name = f"{highest + 1:06d}.safetensors"
        atomic_write(journal / name, data)
        line = {
            "round": round_,
            "device": device,
            "transfer_id": transfer_id,
            "file": name,
            **(verified or PayloadDigest.of(data)).record(),
            "bytes": len(data),
            "meta": dict(meta or {}),
        }
        append_line(journal / INDEX_FILE, json.dumps(line, sort_keys=True))
        devices.add(device)
        self._appended = devices, highest + 1
        return True

    @staticmethod
    def load(entry: JournalEntry) -> dict[str, torch.Tensor]:
        """An accepted upload's tensors, refusing a file whose digest no longer matches the journal."""
        return decode_tensors(RoundJournal.data(entry))

    @staticmethod
    def data(entry: JournalEntry) -> bytes:
        """An accepted upload's bytes as journaled, refusing a file whose digest no longer matches the journal."""
        data = entry.path.read_bytes()
        if not entry.intact(data):
            index = entry.path.parent / INDEX_FILE
            raise RunDirError(f"{entry.path}: sha256 does not match {index}; the file is corrupt")
        return data

    def quarantine(self, entry: JournalEntry, folder: Path, reason: str, when: str) -> Path:
        """Move ``entry`` out of the journal into ``folder`` with a note of ``reason``; returns the note's path.

        The note is written first and the index line dropped second (the commit point), so a crash
        leaves the upload either journaled as before or quarantined, never lost without its reason.
        """
        folder.mkdir(exist_ok=True)
        stem = f"round-{entry.round:06d}-{entry.device}-{entry.transfer_id}"
        note = {"round": entry.round, "device": entry.device, "transfer_id": entry.transfer_id}
        note |= {"sha256": entry.digest.value, "meta": entry.meta, "reason": reason, "quarantined_at": when}
        atomic_write(folder / f"{stem}.json", json.dumps(note, sort_keys=True, default=str).encode())
        index = self.path / INDEX_FILE
        kept = [
            line
            for line in index.read_text().splitlines(keepends=True)
            if not (line.endswith("\n") and _names_file(line, entry.path.name))
        ]
        atomic_write(index, "".join(kept).encode())
        entry.path.replace(folder / f"{stem}.safetensors")
        return folder / f"{stem}.json"

    def repair(self) -> None:
        """Drop a torn last index line and payload files no index line commits."""
        journal, index = self.path, self.path / INDEX_FILE
        text = index.read_text() if index.exists() else ""
        if text and not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]
            atomic_write(index, text.encode())
        entries = self.entries()
        corrupt = [entry for entry in entries if not entry.intact(entry.path.read_bytes())]
        if corrupt:
            for entry in corrupt:
                log.error(
                    "%s: sha256 does not match %s; %s's accepted upload for round %d is dropped",
                    entry.path,
                    index,
                    entry.device,
                    entry.round,
                )
            names = {entry.path.name for entry in corrupt}
            lines = [line for line in text.splitlines(keepends=True) if json.loads(line).get("file") not in names]
            atomic_write(index, "".join(lines).encode())
            entries = [entry for entry in entries if entry.path.name not in names]
        committed = {entry.path.name for entry in entries}
        for payload in journal.glob("*.safetensors"):
            if payload.name not in committed:
                payload.unlink()


def _names_file(line: str, name: str) -> bool:
    """Whether a journal index line is the entry of payload file ``name``."""
    try:
        return Path(json.loads(line)["file"]).name == name
    except (KeyError, TypeError, ValueError):
        return False


__all__ = ["INDEX_FILE", "JournalEntry", "RoundJournal", "RunDirError"]
