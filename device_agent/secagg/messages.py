"""The protocol's messages as plain dataclasses, their canonical bytes (what a signature covers) and a wire form.

Four exchanges, each a server -> device message answered by a device -> server one (Bonawitz et al. 2017):
setup -> advertise keys, neighbour keys -> encrypted shares, forwarded shares -> masked input,
unmask request -> unmask response. Every message names its session (fleet, run, round, attempt) and the one
device it comes from or goes to, so a signature over ``signed_bytes()`` binds it to that round, that device and
that step: replayed into another round or passed off as another step, it no longer verifies.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, fields, is_dataclass
from functools import cached_property
from typing import Any, ClassVar

from device_agent.secagg.crypto import VERSION
from device_agent.secagg.errors import ParameterError, ProtocolViolation
from device_agent.secagg.graph import neighbour_graph, validate
from device_agent.secagg.quantize import Quantizer


@dataclass(frozen=True)
class Session:
    """One run of the protocol. ``attempt`` grows when a round's protocol restarts (fresh keys, never old masks)."""

    fleet: str
    run: str
    round: int
    attempt: int = 0

    @cached_property
    def label(self) -> str:
        return json.dumps([self.fleet, self.run, self.round, self.attempt], separators=(",", ":"))


@dataclass(frozen=True)
class Params:
    """What every party must agree on: who takes part, the threshold, the graph's degree and the quantization."""

    participants: tuple[str, ...]
    threshold: int
    neighbours: int
    length: int
    """Elements in one device's input vector."""
    clip: float
    bits: int

    def __post_init__(self) -> None:
        if tuple(sorted(set(self.participants))) != self.participants:
            raise ParameterError("participants: must be distinct device ids in sorted order")
        validate(len(self.participants), self.threshold, self.neighbours)
        if self.length < 1:
            raise ParameterError(f"length: an input needs at least one element, got {self.length}")
        self.quantizer  # noqa: B018 (validates clip and bits for this many devices)

    @cached_property
    def quantizer(self) -> Quantizer:
        return Quantizer(clip=self.clip, bits=self.bits, devices=len(self.participants))

    def graph(self, session: Session) -> dict[str, frozenset[str]]:
        return neighbour_graph(self.participants, self.neighbours, f"{session.label}/graph".encode())

    def index(self, device: str) -> int:
        """The device's Shamir share index: its position among the participants, from 1."""
        return self.participants.index(device) + 1


class Message:
    """Base of the protocol messages: the device it concerns, its canonical bytes, and its signature."""

    KIND: ClassVar[str]
    session: Session
    signature: str

    @property
    def device(self) -> str:
        """The device that sent it (device -> server) or that it is for (server -> device): whose key signs it."""
        return getattr(self, "sender", None) or self.recipient  # type: ignore[attr-defined]

    def signed_bytes(self) -> bytes:
        """Everything but the signature, in one canonical encoding (a bulk vector by its SHA-256)."""
        body = [_canonical(getattr(self, f.name), f.name) for f in fields(self) if f.name != "signature"]  # type: ignore[arg-type]
        return json.dumps([VERSION, self.KIND, *body], separators=(",", ":")).encode()


def _canonical(value: Any, name: str = "") -> Any:
    if isinstance(value, bytes):
        return ["sha256", hashlib.sha256(value).hexdigest()] if name == "masked" else ["hex", value.hex()]
    if is_dataclass(value):
        return [_canonical(getattr(value, f.name)) for f in fields(value)]
    if isinstance(value, tuple):
        return [_canonical(item) for item in value]
    return value


@dataclass(frozen=True)
class Setup(Message):
    KIND: ClassVar[str] = "setup"
    session: Session
    recipient: str
    params: Params
    signature: str = ""


@dataclass(frozen=True)
class AdvertiseKeys(Message):
    """The device's two fresh X25519 public keys: one to encrypt shares to it, one to agree pairwise masks."""

    KIND: ClassVar[str] = "advertise_keys"
    session: Session
    sender: str
    share_key: bytes
    mask_key: bytes
    signature: str = ""


@dataclass(frozen=True)
class NeighbourKeys(Message):
    """The advertised keys of the recipient's neighbours that are still in: (device, share key, mask key)."""

    KIND: ClassVar[str] = "neighbour_keys"
    session: Session
    recipient: str
    keys: tuple[tuple[str, bytes, bytes], ...]
    signature: str = ""


@dataclass(frozen=True)
class EncryptedShares(Message):
    """(recipient, sealed shares of the sender's mask key and self-mask seed) for each neighbour."""

    KIND: ClassVar[str] = "encrypted_shares"
    session: Session
    sender: str
    shares: tuple[tuple[str, bytes], ...]
    signature: str = ""


@dataclass(frozen=True)
class ForwardedShares(Message):
    """(sender, sealed shares) addressed to the recipient by its neighbours that are still in."""

    KIND: ClassVar[str] = "forwarded_shares"
    session: Session
    recipient: str
    shares: tuple[tuple[str, bytes], ...]
    signature: str = ""


@dataclass(frozen=True)
class MaskedInput(Message):
    """The quantized input plus its masks, as little-endian Z_(2^k) words (see ``quantize.to_bytes``)."""

    KIND: ClassVar[str] = "masked_input"
    session: Session
    sender: str
    masked: bytes
    signature: str = ""


@dataclass(frozen=True)
class UnmaskRequest(Message):
    """Which neighbours dropped (their mask keys' shares wanted) and which survived (their seeds' shares wanted)."""

    KIND: ClassVar[str] = "unmask_request"
    session: Session
    recipient: str
    dropped: tuple[str, ...]
    survivors: tuple[str, ...]
    signature: str = ""


@dataclass(frozen=True)
class UnmaskResponse(Message):
    """(device, share) of the dropped neighbours' mask keys and of the survivors' self-mask seeds."""

    KIND: ClassVar[str] = "unmask_response"
    session: Session
    sender: str
    key_shares: tuple[tuple[str, bytes], ...]
    seed_shares: tuple[tuple[str, bytes], ...]
    signature: str = ""


_KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Setup,
        AdvertiseKeys,
        NeighbourKeys,
        EncryptedShares,
        ForwardedShares,
        MaskedInput,
        UnmaskRequest,
        UnmaskResponse,
    )
}
_NESTED = {"Session": Session, "Params": Params}


def encode(message: Message) -> bytes:
    """Wire form: 4-byte header length, a JSON header, then every bytes field raw (the header points into them)."""
    blobs: list[bytes] = []

    def tree(value: Any) -> Any:
        if isinstance(value, bytes):
            blobs.append(value)
            return {"$b": len(blobs) - 1}
        if is_dataclass(value):
            return {"$t": type(value).__name__, **{f.name: tree(getattr(value, f.name)) for f in fields(value)}}
        if isinstance(value, tuple):
            return [tree(item) for item in value]
        return value

    body = tree(message)
    header = json.dumps({"kind": message.KIND, "sizes": [len(b) for b in blobs], "body": body}).encode()
    return struct.pack(">I", len(header)) + header + b"".join(blobs)


def decode(data: bytes) -> Message:
    """The message ``encode`` wrote; anything malformed is a ``ProtocolViolation``."""
    try:
        (size,) = struct.unpack_from(">I", data)
        header = json.loads(data[4 : 4 + size])
        offsets, position = [], 4 + size
        for length in header["sizes"]:
            offsets.append(data[position : position + length])
            position += length
        if position != len(data):
            raise ValueError("trailing or missing bytes")
        cls = _KINDS[header["kind"]]

        def build(value: Any) -> Any:
            if isinstance(value, dict) and "$b" in value:
                return offsets[value["$b"]]
            if isinstance(value, dict):
                kind = _NESTED.get(value["$t"]) or _KINDS_BY_NAME[value["$t"]]
                return kind(**{key: build(item) for key, item in value.items() if key != "$t"})
            if isinstance(value, list):
                return tuple(build(item) for item in value)
            return value

        message = build(header["body"])
    except (ProtocolViolation, ParameterError):
        raise
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as error:
        raise ProtocolViolation(f"malformed secure-aggregation message: {error}") from None
    if not isinstance(message, cls):
        raise ProtocolViolation(f"message of kind {header['kind']} decodes to {type(message).__name__}")
    return message


_KINDS_BY_NAME = {cls.__name__: cls for cls in _KINDS.values()}
