"""Control messages: JSON, validated by pydantic, versioned by an envelope field ``v``.

Every message is small and idempotent; bulk bytes never travel as JSON (see ``transfer`` for the
binary chunk frames). A receiver parses with ``parse_message``, which raises ``ProtocolError``
naming the problem (bad JSON, missing ``v``, an unknown version, an unknown ``type``, a bad field)
so the session can log and drop a bad message instead of dying on it. An ``incompatible`` error
is the one message read whatever its version: it tells a peer of another version to stop.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from device_agent.clients.spec import ClientSpec, TrainConfig
from device_agent.common.profile import DeviceProfile
from device_agent.common.schema import NAME_PATTERN as _NAME
from device_agent.common.validation import describe
from device_agent.wire.bounds import MESSAGE_CLOCK
from device_agent.wire.json_bounds import nesting_depth

# 3: the assignment carries a typed client spec and training config (2 carried an untyped options dict).
PROTOCOL_VERSION = 3
# Control messages are tiny; anything bigger is a bug or an attack, refused before json.loads.
MAX_MESSAGE_BYTES = 1 << 20
# Every message is a few levels deep; json.loads recurses per level, so deeper input is refused unparsed.
MAX_NESTING = 32
# Only sealed manifests (a digest per chunk) and nacks (missing chunk indexes) grow with a payload.
MAX_BYTES_BY_TYPE = {
    "hello": 64 << 10,
    "assignment": 64 << 10,
    "manifest": MAX_MESSAGE_BYTES,
    "nack": MAX_MESSAGE_BYTES,
    "secagg": MAX_MESSAGE_BYTES,
}
MAX_OTHER_BYTES = 32 << 10

_HEX64 = r"^[0-9a-f]{64}$"
_TRANSFER_ID = r"^[0-9a-f]{32}$"


class ProtocolError(ValueError):
    """A message that does not follow the wire protocol; the text says what is wrong."""


class VersionMismatch(ProtocolError):
    """A message of another protocol version: the peer needs another release, not a retry."""

    def __init__(self, version: object) -> None:
        super().__init__(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
        self.version = version


class _Message(BaseModel):
    # Unknown fields are refused rather than ignored: within one protocol version both sides agree
    # on every field, and a typo must not silently become a default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[3] = PROTOCOL_VERSION
    sent_at: Annotated[
        float, Field(ge=MESSAGE_CLOCK.low, le=MESSAGE_CLOCK.high, allow_inf_nan=False, default_factory=time.time)
    ]


class Hello(_Message):
    """First message of a device after every (re)connect: who it is and what it can do now."""

    type: Literal["hello"] = "hello"
    device: Annotated[str, Field(pattern=_NAME)]
    agent_version: str
    profile: DeviceProfile


class Assignment(_Message):
    """The coordinator's order for one round: which payload to train on, how, and what to send back.

    ``spec`` is the strategy's typed client spec (model, level, strategy options); ``train`` the
    local training config. Both are validated here, so a device never starts a round on a guess.
    """

    type: Literal["assignment"] = "assignment"
    run: Annotated[str, Field(pattern=_NAME)]
    round: Annotated[int, Field(ge=0)]
    deadline_s: Annotated[float, Field(gt=0)]
    download: Annotated[str, Field(pattern=_TRANSFER_ID)]
    spec: ClientSpec
    train: TrainConfig


class Manifest(_Message):
    """Announces one transfer; ``digest`` is sha256 over the concatenated chunk digests (a hash list).

    A hash list lets each side hash every byte exactly once (per chunk, as it goes) and still binds
    the whole transfer: changing any byte changes a chunk digest and therefore the transfer digest.

    A manifest is *sealed* when it carries ``chunks`` and ``digest``. A sender that has not hashed
    the payload yet announces it unsealed, hashes each chunk as it publishes it (every chunk frame
    carries its own sha256), and sends the sealed manifest after the last chunk; the receiver
    completes a transfer only against a seal. Hashing then overlaps sending instead of delaying it.
    """

    type: Literal["manifest"] = "manifest"
    transfer: Annotated[str, Field(pattern=_TRANSFER_ID)]
    run: str = ""
    round: Annotated[int, Field(ge=0)] = 0
    kind: str = "payload"
    size: Annotated[int, Field(ge=0)]
    chunk_size: Annotated[int, Field(gt=0)]
    chunks: list[Annotated[str, Field(pattern=_HEX64)]] | None = None
    digest: Annotated[str, Field(pattern=_HEX64)] | None = None
    meta: dict[str, str] = Field(default_factory=dict)

    @property
    def chunk_count(self) -> int:
        return -(-self.size // self.chunk_size)

    @property
    def sealed(self) -> bool:
        return self.digest is not None

    @model_validator(mode="after")
    def _chunk_count_matches_size(self) -> Manifest:
        if (self.chunks is None) != (self.digest is None):
            raise ValueError(f"manifest {self.transfer}: carries chunk digests or a transfer digest without the other")
        expected = self.chunk_count
        if self.chunks is not None and len(self.chunks) != expected:
            raise ValueError(
                f"manifest {self.transfer}: {len(self.chunks)} chunk digests for size {self.size} "
                f"in chunks of {self.chunk_size} (expected {expected})"
            )
        return self


class Ack(_Message):
    """The receiver holds the complete, verified transfer; the sender may forget it."""

    type: Literal["ack"] = "ack"
    transfer: Annotated[str, Field(pattern=_TRANSFER_ID)]
    digest: Annotated[str, Field(pattern=_HEX64)]


class Nack(_Message):
    """The receiver still misses these chunks (never arrived, or arrived corrupt): resend them.

    An empty list: it has every chunk but not the seal (the sealed manifest), so send that again.
    """

    type: Literal["nack"] = "nack"
    transfer: Annotated[str, Field(pattern=_TRANSFER_ID)]
    missing: list[Annotated[int, Field(ge=0)]]


class Status(_Message):
    """Heartbeat and state of a device; published retained, and as the last will with ``offline``."""

    type: Literal["status"] = "status"
    device: Annotated[str, Field(pattern=_NAME)]
    state: Literal["online", "idle", "downloading", "training", "uploading", "offline"]
    detail: str = ""


class Error(_Message):
    """Tells the peer why something it sent was refused, so failures are visible on both sides."""

    type: Literal["error"] = "error"
    code: Literal["malformed", "unknown_transfer", "too_large", "rejected", "internal", "incompatible"]
    detail: str
    transfer: str | None = None


class Receipt(_Message):
    """The coordinator journaled an update (or no longer needs it): the device may delete its copy.

    A transfer ``Ack`` only says the bytes arrived intact; a receipt says the update is durable in
    the run (``accepted``/``duplicate``) or will never be used (``late``: its round has closed).
    """

    type: Literal["receipt"] = "receipt"
    run: Annotated[str, Field(pattern=_NAME)]
    round: Annotated[int, Field(ge=0)]
    transfer: Annotated[str, Field(pattern=_TRANSFER_ID)]
    status: Literal["accepted", "duplicate", "late"]


FailureReason = Literal["out_of_memory", "state_lost", "bad_assignment", "error"]
"""Why a device could not do its round; ``error`` is any other exception (a program's bug, unreadable data)."""


class RoundFailed(_Message):
    """A device could not do its round (out of memory, bad data, ...): the coordinator stops waiting for it.

    ``bad_assignment``: the payload did not fit the model the spec builds (names, shapes, dtypes, finite values).
    """

    type: Literal["round_failed"] = "round_failed"
    run: Annotated[str, Field(pattern=_NAME)]
    round: Annotated[int, Field(ge=0)]
    reason: FailureReason
    detail: str = ""


class SecAgg(_Message):
    """One secure-aggregation protocol message (``device_agent.secagg.messages``' wire form, base64) of a round.

    Either way: the coordinator's setup, keys, shares and unmask requests, a device's answers. The protocol
    message inside is signed and names its session itself; ``run`` and ``round`` only route it. A masked input
    is the model's size and travels as a payload, not in this message.
    """

    type: Literal["secagg"] = "secagg"
    run: Annotated[str, Field(pattern=_NAME)]
    round: Annotated[int, Field(ge=0)]
    body: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9+/]+={0,2}$")]
    weight: Annotated[float, Field(gt=0, le=1)] | None = None
    """With the coordinator's setup: the factor the device scales its update by (its samples over the round's
    largest share; public, from fleet.yaml), so that the unmasked sum is the sample-weighted one."""
    layout: dict[str, Any] | None = None
    """With the coordinator's setup, for strategies whose devices train a part or another form of the global
    model (width slices, low-rank factors): where each tensor of the update goes in the one summed vector
    (``device_agent.agent.secure.Layout``). None: the update's own tensors in key order (FedAvg)."""
    noise: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    """With the coordinator's setup under ``privacy``: the std of the Gaussian noise the device adds to each value
    of its clipped update before masking (its share of the round's noise; docs/secure-aggregation.md)."""


INCOMPATIBLE = "incompatible"


def incompatible(peer_version: object) -> Error:
    """The answer to a message of another protocol version; understood by every version since 3.

    Its three fields (``type``, ``code``, ``detail``) are the part of the protocol that never
    changes, so the peer reads it whatever version it speaks and can stop instead of retrying.
    """
    return Error(
        code=INCOMPATIBLE,
        detail=f"protocol version {peer_version!r} is not spoken here (this side speaks {PROTOCOL_VERSION}); "
        "install the agent kit that matches the coordinator's release",
    )


def refuses_version(error: Error, version: object = PROTOCOL_VERSION) -> bool:
    """Whether an ``incompatible`` error says its sender cannot read messages of ``version`` (this side's).

    An answer to someone else's message of another version (a login used by two clients) names that
    version, not this side's: its receiver ignores it instead of stopping.
    """
    return error.code == INCOMPATIBLE and error.detail.startswith(f"protocol version {version!r} is not spoken here")


Message = Annotated[
    Hello | Assignment | Manifest | Ack | Nack | Status | Error | Receipt | RoundFailed | SecAgg,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def encode(message: _Message) -> bytes:
    """Compact JSON bytes of a message, ready to publish."""
    return message.model_dump_json().encode()


def parse_message(data: bytes | str) -> Message:
    """Decode and validate one control message, or raise ``ProtocolError`` saying what is wrong."""
    raw_bytes = data.encode(errors="surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw_bytes) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {len(raw_bytes)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    if nesting_depth(raw_bytes) > MAX_NESTING:
        raise ProtocolError(f"control message nested deeper than {MAX_NESTING} levels")
    try:
        raw = json.loads(raw_bytes)
    except ValueError as exc:  # not UTF-8, not JSON, or a number past int's digit limit
        raise ProtocolError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    limit = MAX_BYTES_BY_TYPE.get(kind, MAX_OTHER_BYTES) if isinstance(kind, str) else MAX_OTHER_BYTES
    if len(raw_bytes) > limit:
        raise ProtocolError(f"{kind!r} message of {len(raw_bytes)} bytes exceeds its {limit}-byte limit")
    if "v" not in raw:
        raise ProtocolError("missing protocol version field 'v'")
    if raw["v"] != PROTOCOL_VERSION:
        if raw.get("type") == "error" and raw.get("code") == INCOMPATIBLE:
            return Error(code=INCOMPATIBLE, detail=str(raw.get("detail", ""))[:1000])
        raise VersionMismatch(raw["v"])
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        problems = describe(exc, empty="<message>")
        raise ProtocolError(f"invalid {raw.get('type', 'message')!r} message: {problems}") from None
