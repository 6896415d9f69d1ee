"""Announcing a transfer: its manifest, sealed (every chunk digest and the transfer digest) or not yet, and the
size limits a sender checks before its first frame leaves (an MQTT broker drops what paho publishes over them).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from device_agent.wire.engine.frames import HEADER_SIZE, new_transfer_id, transfer_digest
from device_agent.wire.messages import Manifest, encode

DEFAULT_CHUNK_SIZE = 256 * 1024
# Room for the MQTT fixed header, topic and properties when checking a frame against a packet limit.
PACKET_OVERHEAD = 512


class TransferError(RuntimeError):
    """A transfer that cannot be sent or completed."""


class PayloadTooLarge(TransferError, ValueError):
    """Refused before anything was published: the payload or a frame would exceed a limit."""


@dataclass(frozen=True)
class Limits:
    """What a sender may publish. Checked before the first byte leaves (paho does not check)."""

    max_payload_bytes: int = 1 << 30
    max_packet_bytes: int = 8 * 1024 * 1024

    def check(self, size: int, chunk_size: int) -> None:
        if size > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"payload of {size} bytes exceeds the {self.max_payload_bytes}-byte transfer limit; nothing was sent"
            )
        frame = chunk_size + HEADER_SIZE + PACKET_OVERHEAD
        if frame > self.max_packet_bytes:
            raise PayloadTooLarge(
                f"chunks of {chunk_size} bytes make {frame}-byte packets, over the broker's "
                f"{self.max_packet_bytes}-byte maximum packet size; use a smaller chunk size"
            )


def announce(
    size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    run: str = "",
    round: int = 0,
    kind: str = "payload",
    meta: dict[str, str] | None = None,
    limits: Limits | None = None,
    transfer: str | None = None,
) -> Manifest:
    """An unsealed manifest for ``size`` bytes (nothing hashed yet); refused first if it breaks ``limits``."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    (limits or Limits()).check(size, chunk_size)
    return Manifest(
        transfer=transfer or new_transfer_id(),
        run=run,
        round=round,
        kind=kind,
        size=size,
        chunk_size=chunk_size,
        meta=meta or {},
    )


def seal(manifest: Manifest, chunk_digests: list[bytes]) -> Manifest:
    """``manifest`` carrying the given chunk digests and the transfer digest over them."""
    hexes = [d.hex() for d in chunk_digests]
    return Manifest.model_validate(
        manifest.model_dump() | {"chunks": hexes, "digest": transfer_digest(hexes), "sent_at": time.time()}
    )


def make_manifest(payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE, **fields: Any) -> Manifest:
    """Hash ``payload`` chunk by chunk into a sealed manifest; refuse it first if it breaks ``limits``.

    Takes the keywords of ``announce``. The manifest can be reused to send the same bytes to many
    receivers (``Session.send(..., manifest=)``): only ``transfer`` differs, nothing is rehashed.
    """
    manifest = announce(len(payload), chunk_size, **fields)
    view = memoryview(payload)
    return seal(
        manifest, [hashlib.sha256(view[i : i + chunk_size]).digest() for i in range(0, len(payload), chunk_size)]
    )


def announced(manifest: Manifest) -> dict[str, Any]:
    """What announcing and sealing a transfer must agree on."""
    return manifest.model_dump(exclude={"sent_at", "chunks", "digest"})


def check_packet(limits: Limits, size: int, what: str) -> None:
    """Refuse a frame the broker would drop for its size (paho does not check)."""
    if size + PACKET_OVERHEAD > limits.max_packet_bytes:
        raise PayloadTooLarge(
            f"{what} of {size} bytes would exceed the broker's {limits.max_packet_bytes}-byte "
            "maximum packet size; nothing was sent"
        )


def for_sending(
    payload: bytes, manifest: Manifest | None, chunk_size: int, limits: Limits, **manifest_fields: Any
) -> Manifest:
    """The manifest ``payload`` goes out with, refused now if the transfer breaks a limit.

    A given ``manifest`` (``make_manifest``, to send the same bytes to several receivers without rehashing)
    gets a fresh transfer id unless ``transfer=`` names one; otherwise ``payload`` is announced unsealed with
    ``manifest_fields``.
    """
    if manifest is None:
        manifest = announce(len(payload), chunk_size, limits=limits, **manifest_fields)
    else:
        limits.check(manifest.size, manifest.chunk_size)
        manifest = manifest.model_copy(update={"transfer": manifest_fields.get("transfer") or new_transfer_id()})
    # The seal is the largest control message of a transfer: check it before the first byte leaves.
    placeholder = ["0" * 64] * manifest.chunk_count
    seal = manifest.model_copy(update={"chunks": placeholder, "digest": "0" * 64})
    check_packet(limits, len(encode(seal)), "manifest")
    return manifest
