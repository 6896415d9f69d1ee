"""The agent's outbox: a finished update stays on disk until the coordinator acknowledges it.

Training a round on a Raspberry Pi can take many minutes; a reboot, a crash or a broker outage
between the end of training and the coordinator's ack must not throw that work away. Each update is
stored as the exact safetensors bytes that go on the wire (so the transfer's sha256 is the file's)
plus a small JSON sidecar. The payload is written first and the sidecar last: an update exists once
its sidecar does, and a payload without one is debris from a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from device_agent.common.atomic import atomic_write, remove_temp_files
from device_agent.wire.codec import decode_tensors, encode_tensors

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class OutboxCorrupt(Exception):
    """A stored update whose bytes no longer match the digest recorded when it was written."""


@dataclass(frozen=True)
class OutboxItem:
    """One finished update waiting for its ack."""

    run: str
    round: int
    transfer_id: str
    sha256: str
    size: int
    payload_path: Path
    meta: dict[str, Any]


def _check_name(kind: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must be 1-128 characters of letters, digits, '_', '.', '-'")
    return value


class Outbox:
    """Updates waiting for an ack, in one directory owned by one agent process."""

    def __init__(self, directory: Path) -> None:
        """Open (or create) the outbox at agent start-up and clear what a crash left half-written."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_temp_files(self.directory)
        committed = {path.with_suffix(".safetensors") for path in self.directory.glob("*.json")}
        for payload in self.directory.glob("*.safetensors"):
            if payload not in committed:
                payload.unlink()

    def _stem(self, run: str, round_: int, transfer_id: str) -> str:
        return f"{_check_name('run', run)}.r{round_:06d}.{_check_name('transfer id', transfer_id)}"

    def put(
        self,
        run: str,
        round_: int,
        transfer_id: str,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        fp16: bool = False,
    ) -> OutboxItem:
        """Store an update durably before the first byte of it is sent; returns what to send and check.

        Encoded by the wire codec, the one tensor encoder of both sides (``fp16`` halves the bytes of
        float tensors; the coordinator restores their dtypes on decode).
        """
        stem = self._stem(run, round_, transfer_id)
        data = encode_tensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, fp16=fp16)
        digest = hashlib.sha256(data).hexdigest()
        payload_path = self.directory / f"{stem}.safetensors"
        atomic_write(payload_path, data)
        sidecar = {
            "run": run,
            "round": round_,
            "transfer_id": transfer_id,
            "sha256": digest,
            "size": len(data),
            "meta": dict(meta or {}),
        }
        atomic_write(self.directory / f"{stem}.json", json.dumps(sidecar, indent=2).encode())
        return OutboxItem(run, round_, transfer_id, digest, len(data), payload_path, dict(meta or {}))

    def pending(self) -> list[OutboxItem]:
        """Updates still waiting for an ack (e.g. after a restart), oldest round first.

        A sidecar that cannot be read is an error naming the file, not an update silently forgotten.
        """
        items = []
        for sidecar in self.directory.glob("*.json"):
            try:
                raw = json.loads(sidecar.read_text())
                item = OutboxItem(
                    run=_check_name("run", raw["run"]),
                    round=int(raw["round"]),
                    transfer_id=_check_name("transfer id", raw["transfer_id"]),
                    sha256=str(raw["sha256"]),
                    size=int(raw["size"]),
                    payload_path=sidecar.with_suffix(".safetensors"),
                    meta=dict(raw.get("meta") or {}),
                )
            except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
                raise OutboxCorrupt(
                    f"{sidecar}: not an outbox entry ({type(exc).__name__}: {str(exc)[:200]})"
                ) from None
            items.append(item)
        return sorted(items, key=lambda item: (item.run, item.round, item.transfer_id))

    def payload(self, item: OutboxItem) -> bytes:
        """The bytes to send, refusing a file whose sha256 differs from the one recorded at put()."""
        try:
            data = item.payload_path.read_bytes()
        except FileNotFoundError:
            raise OutboxCorrupt(f"{item.payload_path} is missing") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != item.sha256:
            raise OutboxCorrupt(
                f"{item.payload_path}: sha256 {digest[:12]}... does not match the recorded {item.sha256[:12]}...; "
                "the update is corrupt and must not be sent"
            )
        return data

    def tensors(self, item: OutboxItem) -> dict[str, torch.Tensor]:
        return decode_tensors(self.payload(item))

    def ack(self, run: str, round_: int, transfer_id: str) -> bool:
        """Forget an update the coordinator has acknowledged; False if it was not (or no longer) here."""
        stem = self._stem(run, round_, transfer_id)
        sidecar = self.directory / f"{stem}.json"
        if not sidecar.exists():
            return False
        sidecar.unlink()  # the sidecar first: a crash in between leaves debris, never a half entry
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{stem}.safetensors").unlink()
        return True

    def discard(self, item: OutboxItem) -> None:
        """Drop an update the coordinator will never take (its round closed, or it is corrupt)."""
        self.ack(item.run, item.round, item.transfer_id)
