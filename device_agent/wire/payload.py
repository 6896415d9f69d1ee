"""A payload as a transport hands it over: what it is (run, round, kind, meta), its bytes, and their digest.

The round engine, the journal and the upload signature see a :class:`Received` and nothing of how the
bytes came (manifests, chunks, acks stay inside the transport). Its :class:`PayloadDigest` is opaque to
them: the signature binds ``digest.value``, the journal keeps ``digest.record()`` and re-checks a file
read back on resume with ``digest.matches``, so the bytes are hashed once, by the transport, as they
arrive.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from device_agent.wire.transfer import Completed, transfer_digest


@dataclass(frozen=True)
class PayloadDigest:
    """A digest and the scheme that recomputes it: a transfer digest over chunks of ``chunk_size``, or sha256."""

    value: str
    chunk_size: int | None = None

    @classmethod
    def of(cls, data: bytes | memoryview, chunk_size: int | None = None) -> PayloadDigest:
        if chunk_size is None:
            return cls(hashlib.sha256(data).hexdigest())
        view = memoryview(data)
        chunks = [hashlib.sha256(view[i : i + chunk_size]).hexdigest() for i in range(0, len(view), chunk_size)]
        return cls(transfer_digest(chunks), chunk_size)

    def matches(self, data: bytes | memoryview) -> bool:
        return PayloadDigest.of(data, self.chunk_size).value == self.value

    def record(self) -> dict[str, Any]:
        """The journal's fields for it (the names earlier journals used, so they still resume)."""
        return {"sha256": self.value, "chunk_size": self.chunk_size}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PayloadDigest:
        chunk_size = record.get("chunk_size")
        return cls(str(record["sha256"]), None if chunk_size is None else int(chunk_size))


class Received:
    """A complete payload whose bytes matched ``digest``; ``data`` is joined on first use, in the reader's thread."""

    def __init__(
        self,
        *,
        run: str,
        round: int,
        kind: str,
        transfer: str,
        meta: Mapping[str, Any],
        digest: PayloadDigest | None,
        data: bytes | Callable[[], bytes],
        size: int | None = None,
    ) -> None:
        self.run, self.round, self.kind, self.transfer = run, round, kind, transfer
        self.meta = dict(meta)
        self.digest = digest
        self._data, self._load = (data, None) if isinstance(data, bytes) else (None, data)
        self.size = len(data) if isinstance(data, bytes) else size
        self._lock = threading.Lock()

    @property
    def data(self) -> bytes:
        with self._lock:
            if self._load is not None:
                self._data, self._load = self._load(), None
            return self._data or b""

    def replaced(
        self, data: bytes | None = None, meta: Mapping[str, Any] | None = None, transfer: str | None = None
    ) -> Received:
        """The same payload with other bytes (digested again, in the same scheme), meta or transfer id.

        What a man in the middle (a test's, a benchmark's attacker) hands the engine.
        """
        digest = self.digest
        if data is not None:
            digest = PayloadDigest.of(data, None if digest is None else digest.chunk_size)
        return Received(
            run=self.run,
            round=self.round,
            kind=self.kind,
            transfer=transfer or self.transfer,
            meta=self.meta if meta is None else meta,
            digest=digest,
            data=self.data if data is None else data,
        )

    @classmethod
    def of(cls, completed: Completed) -> Received:
        """A verified chunked transfer (MQTT's) as the engine takes it."""
        manifest = completed.manifest
        digest = None if manifest.digest is None else PayloadDigest(manifest.digest, manifest.chunk_size)
        return cls(
            run=manifest.run,
            round=manifest.round,
            kind=manifest.kind,
            transfer=manifest.transfer,
            meta=manifest.meta,
            digest=digest,
            data=lambda: completed.data,
            size=manifest.size,
        )


__all__ = ["PayloadDigest", "Received"]
