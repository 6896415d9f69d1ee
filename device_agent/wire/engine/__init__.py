"""The sans-IO transfer engine: chunked, verified, resumable transfers with no network, thread or clock of its own.

A sender announces a transfer with a ``Manifest`` (size, chunk size), sends binary chunk frames that each
carry their chunk's sha256 (``frames``), and seals the transfer with the manifest again, now holding every
chunk digest and the transfer digest over those (a sender that hashed the payload beforehand, e.g. to send it
to many devices, announces it sealed at once: ``manifests``). The receiver checks each chunk against its
frame's digest (and the seal's, once known), keeps it, and acks once every chunk is in and the seal holds.
Loss is repaired by asking again, never by trusting a carrier's queue:

- the receiver nacks the chunks it still misses when nothing has arrived for ``nack_after`` s since the last
  chunk it took (an empty nack: it has every chunk but no seal, and the sender answers with the seal); a nack
  lists at most ``max_nack_chunks`` indexes, the lowest, and the next ones are asked for as soon as those are
  in. A receiver never nacks a transfer that made no progress since its last nack, and answers a repeated
  manifest with a nack at most once per ``nack_after``: what it sends stays within a small multiple of what it
  receives, whatever a manifest announces (``incoming``);
- the sender re-announces the manifest when it has heard nothing for ``resend_after`` s (a lost manifest or a
  lost ack), backing off; a receiver answers a known manifest with a nack or a repeated ack (``outgoing``);
- duplicates, chunks of finished transfers and chunks that fail their digest are dropped; chunks that
  disagree with the seal are dropped and asked for again;
- after a reconnect senders re-announce and receivers nack at once (``resume``).

``outgoing`` and ``incoming`` are the two sides of one transfer; ``senders``, ``receivers`` and ``window`` keep
every transfer of an endpoint; ``core.TransferEngine`` joins them: frames in (with the time), frames and events
(``events``: a payload received, a delivery settled) out. Every call takes ``now`` from the caller, so tests
drive it with a fake clock and a carrier with ``time.monotonic``.
"""

from device_agent.wire.engine.core import TransferEngine
from device_agent.wire.engine.events import NOTHING, Arrived, Outbound, Output, Outputs, Settled
from device_agent.wire.engine.incoming import Completed, IncomingTransfers
from device_agent.wire.engine.outgoing import OutgoingTransfer

__all__ = [
    "NOTHING",
    "Arrived",
    "Completed",
    "IncomingTransfers",
    "Outbound",
    "OutgoingTransfer",
    "Output",
    "Outputs",
    "Settled",
    "TransferEngine",
]
