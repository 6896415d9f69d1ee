"""Per-device signatures on uploads: HMAC-SHA256 over an update's identity, its transfer digest and its meta.

The broker authenticates a login, not an update: anyone holding a device's password (or a copy of an
update captured earlier) can publish on its topic. A key that only the device's kit and the
coordinator's kits hold binds the payload to (fleet, run, round, device, transfer id), so the
coordinator can refuse an update signed with another key (``bad_signature``) and a genuine one sent
again as another round's or under another transfer id (``replayed``). The signed round and transfer
travel in the manifest meta next to the MAC, which is what tells a replay from a forgery.

The bytes are bound through the transfer digest (sha256 over the chunk digests, see
:func:`device_agent.wire.transfer.transfer_digest`), which both sides compute anyway to move the
payload: the coordinator verifies each chunk once and never hashes the whole payload again.

The MAC also covers every other meta entry (samples, seconds, loss, accuracies): the sample count weights
the update in the average, so one a login could change would let it weight a device up to 100x. An
upload signed the way earlier releases did (identity only, ``-v2``) is refused as ``outdated_signature``
with what to install, never taken for a forgery of the device or accepted with unsigned meta.

Shared by the agent (signs) and the coordinator (verifies); standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

SIGNATURE = "signature"
SIGNED_ROUND = "signed_round"
SIGNED_TRANSFER = "signed_transfer"
KEY_BYTES = 32
_VERSION = "fedfleet-upload-signature-v3"
_IDENTITY_ONLY = "fedfleet-upload-signature-v2"
_HEX_MAC = re.compile(r"[0-9a-f]{64}")


class SignatureError(ValueError):
    """An upload whose signature is missing, forged or replayed; ``reason`` is the refusal's short code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class UploadIdentity:
    """What a signature binds: which update of which device in which round, and which bytes (``digest``)."""

    fleet: str
    run: str
    round: int
    device: str
    transfer: str
    digest: str
    """The transfer digest of the update's payload (what its sealed manifest carries)."""

    def signed_bytes(self, meta: Mapping[str, str]) -> bytes:
        """The identity and every meta entry but the MAC itself, in one canonical encoding."""
        fields = [_VERSION, self.fleet, self.run, self.round, self.device, self.transfer, self.digest]
        covered = sorted((key, value) for key, value in meta.items() if key != SIGNATURE)
        return json.dumps([*fields, covered], separators=(",", ":")).encode()

    def identity_only_bytes(self) -> bytes:
        """What releases before the meta was signed signed: told apart to refuse them by name."""
        fields = [_IDENTITY_ONLY, self.fleet, self.run, self.round, self.device, self.transfer, self.digest]
        return json.dumps(fields, separators=(",", ":")).encode()


def parse_key(text: str, what: str = "signing key") -> bytes:
    """A key from its hex text (what provisioning writes); too short or not hex is an error naming ``what``."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{what}: not hexadecimal") from None
    if len(key) < 16:
        raise ValueError(f"{what}: {len(key)} bytes, at least 16 needed")
    return key


def sign(key: bytes, identity: UploadIdentity, meta: Mapping[str, str]) -> str:
    return hmac.new(key, identity.signed_bytes(meta), hashlib.sha256).hexdigest()


def signed_meta(meta: Mapping[str, str], key: bytes, identity: UploadIdentity) -> dict[str, str]:
    """``meta`` plus the round and transfer it was made for, and the signature over all of it and ``identity``."""
    covered = {**meta, SIGNED_ROUND: str(identity.round), SIGNED_TRANSFER: identity.transfer}
    return {**covered, SIGNATURE: sign(key, identity, covered)}


def verify(key: bytes, meta: Mapping[str, str], identity: UploadIdentity) -> None:
    """Return if ``meta`` signs ``identity`` with ``key``; else ``SignatureError`` saying which way it fails.

    The MAC is checked (in constant time) over the meta and the round and transfer it claims it was made
    for: a mismatch means another key or altered fields; a valid MAC for another round or transfer
    than this upload's means a genuine update sent again.
    """
    if SIGNATURE not in meta:
        raise SignatureError(
            "unsigned", f"update of {identity.device} is not signed; this fleet requires signed uploads"
        )
    try:
        claimed_round = int(meta[SIGNED_ROUND])
        claimed_transfer = meta[SIGNED_TRANSFER]
    except (KeyError, ValueError):
        raise SignatureError("bad_signature", "update signature lacks a readable signed round and transfer") from None
    claimed = UploadIdentity(
        identity.fleet, identity.run, claimed_round, identity.device, claimed_transfer, identity.digest
    )
    signature = meta[SIGNATURE]
    if not (isinstance(signature, str) and _HEX_MAC.fullmatch(signature)):
        raise SignatureError("bad_signature", "update signature is not 64 hexadecimal digits")
    if not hmac.compare_digest(sign(key, claimed, meta), signature):
        identity_only = hmac.new(key, claimed.identity_only_bytes(), hashlib.sha256).hexdigest()
        if hmac.compare_digest(identity_only, signature):
            raise SignatureError(
                "outdated_signature",
                f"update of {identity.device} is signed by an agent release whose signature does not cover the "
                "meta (samples, loss); install the agent kit of the coordinator's release",
            )
        raise SignatureError(
            "bad_signature", f"update signature does not verify with {identity.device}'s key (payload, round or meta)"
        )
    if (claimed.round, claimed.transfer) != (identity.round, identity.transfer):
        raise SignatureError(
            "replayed",
            f"update signed for round {claimed.round} transfer {claimed.transfer} arrived as "
            f"round {identity.round} transfer {identity.transfer}",
        )
