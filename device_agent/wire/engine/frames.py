"""The chunk frame: a 57-byte binary header and the raw bytes of one chunk (no base64, no JSON).

``b"FFCK" | version (1 byte) | transfer id (16 bytes) | chunk index (uint32, big-endian) | sha256 (32 bytes)``

A transfer's digest is a hash list: sha256 over its chunks' binary digests, so each side hashes every byte
once (per chunk, as it goes) and still binds the whole payload.
"""

from __future__ import annotations

import hashlib
import struct
import uuid

from device_agent.wire.messages import ProtocolError

CHUNK_MAGIC = b"FFCK"
FRAME_VERSION = 2
_HEADER = struct.Struct(">4sB16sI32s")
HEADER_SIZE = _HEADER.size


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def transfer_digest(chunk_digests: list[str]) -> str:
    """sha256 over the concatenated binary chunk digests: binds every byte, costs almost nothing."""
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in chunk_digests)).hexdigest()


def is_chunk_frame(data: bytes | memoryview) -> bool:
    return data[:4] == CHUNK_MAGIC


def chunk_frame(transfer: str, index: int, data: bytes | memoryview, digest: bytes | None = None) -> bytes:
    """A frame for ``data``; ``digest`` is its sha256 when the caller has it already."""
    digest = digest if digest is not None else hashlib.sha256(data).digest()
    return _HEADER.pack(CHUNK_MAGIC, FRAME_VERSION, bytes.fromhex(transfer), index, digest) + data


def parse_chunk_frame(frame: bytes | memoryview) -> tuple[str, int, memoryview, bytes]:
    """(transfer id, chunk index, chunk bytes, their claimed sha256) of a frame, or ``ProtocolError``."""
    # Magic and version first: a frame of another version may have another header length.
    if frame[:4] != CHUNK_MAGIC:
        raise ProtocolError(f"not a chunk frame (magic {bytes(frame[:4])!r})")
    if len(frame) > 4 and frame[4] != FRAME_VERSION:
        raise ProtocolError(f"unsupported chunk frame version {frame[4]} (this side speaks {FRAME_VERSION})")
    if len(frame) < HEADER_SIZE:
        raise ProtocolError(f"chunk frame of {len(frame)} bytes is shorter than its {HEADER_SIZE}-byte header")
    _magic, _version, transfer, index, digest = _HEADER.unpack_from(frame)
    return transfer.hex(), index, memoryview(frame)[HEADER_SIZE:], digest


def chunk_is_intact(data: bytes | memoryview, digest: bytes) -> bool:
    """Whether ``data`` hashes to ``digest``; thread-safe and lock-free (hashlib drops the GIL on big buffers)."""
    return hashlib.sha256(data).digest() == digest
