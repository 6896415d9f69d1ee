"""Signing protocol messages with the per-device HMAC keys fedfleet already provisions (agent/signing.py).

HMAC-SHA256 under the key only the device and the coordinator hold authenticates each message between those
two: a device's keys, shares, masked input and unmask response cannot be forged or replayed by other logins
on the broker, and a device can tell the coordinator's messages from anyone else's. It does not let one device
check another's advertised keys (that would take asymmetric signatures and a PKI): the coordinator is trusted
to forward keys unaltered, which is the honest-but-curious model of docs/secure-aggregation.md.

Anything with ``sign`` and ``verify`` (a transport's own signer, an Ed25519 one) can stand in for ``HmacAuth``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol, TypeVar

from device_agent.secagg.errors import ProtocolViolation
from device_agent.secagg.messages import Message

_DOMAIN = b"fedfleet-secagg-signature-v1\x00"
M = TypeVar("M", bound=Message)


class Authenticator(Protocol):
    def sign(self, device: str, data: bytes) -> str: ...

    def verify(self, device: str, data: bytes, signature: str) -> None:
        """Return if ``signature`` signs ``data`` for ``device``; else raise ``ProtocolViolation``."""
        ...


class HmacAuth:
    """HMAC-SHA256 with each device's key: a device holds its own, the coordinator every device's."""

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self._keys = dict(keys)

    def _mac(self, device: str, data: bytes) -> str:
        key = self._keys.get(device)
        if key is None:
            raise ProtocolViolation(f"no signing key for device {device!r}")
        return hmac.new(key, _DOMAIN + data, hashlib.sha256).hexdigest()

    def sign(self, device: str, data: bytes) -> str:
        return self._mac(device, data)

    def verify(self, device: str, data: bytes, signature: str) -> None:
        if not hmac.compare_digest(self._mac(device, data), signature):
            raise ProtocolViolation(f"signature of a message of {device!r} does not verify")


def signed(message: M, auth: Authenticator | None) -> M:
    """``message`` with its signature (unchanged without an authenticator)."""
    if auth is None:
        return message
    return replace(message, signature=auth.sign(message.device, message.signed_bytes()))


def check(message: Message, auth: Authenticator | None) -> None:
    if auth is not None:
        auth.verify(message.device, message.signed_bytes(), message.signature)
