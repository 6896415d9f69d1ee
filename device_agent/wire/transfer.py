"""The names other packages import for chunked transfers, kept where they have always been.

The transfers themselves are the sans-IO engine's (``device_agent.wire.engine``: frames, manifests, the
outgoing and incoming state machines); this module only re-exports what the coordinator, the agent, the
benchmarks and kits import, so none of them changes when the engine's modules do.
"""

from device_agent.wire.engine.frames import (
    HEADER_SIZE,
    chunk_frame,
    chunk_is_intact,
    is_chunk_frame,
    new_transfer_id,
    parse_chunk_frame,
    transfer_digest,
)
from device_agent.wire.engine.incoming import Completed, IncomingTransfers, ReceiverStats
from device_agent.wire.engine.manifests import (
    DEFAULT_CHUNK_SIZE,
    Limits,
    PayloadTooLarge,
    TransferError,
    announce,
    make_manifest,
    seal,
)
from device_agent.wire.engine.outgoing import OutgoingTransfer

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HEADER_SIZE",
    "Completed",
    "IncomingTransfers",
    "Limits",
    "OutgoingTransfer",
    "PayloadTooLarge",
    "ReceiverStats",
    "TransferError",
    "announce",
    "chunk_frame",
    "chunk_is_intact",
    "is_chunk_frame",
    "make_manifest",
    "new_transfer_id",
    "parse_chunk_frame",
    "seal",
    "transfer_digest",
]
