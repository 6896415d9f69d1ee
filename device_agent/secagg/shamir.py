"""Shamir's (t, n) threshold secret sharing over the prime field GF(2^256 + 297).

Why not pycryptodome's ``Crypto.Protocol.SecretSharing.Shamir``: it shares 16-byte secrets only, and
what SecAgg shares are 32-byte values (an X25519 private key, a 32-byte self-mask seed). Splitting each
into two halves would double the shares and the bookkeeping; a 257-bit prime field holds them whole.
2^256 + 297 is the smallest prime above 2^256, so every 32-byte string is a field element.

A share is (x, y) with x = the holder's index (>= 1) and y = f(x), f of degree t - 1 with f(0) = the
secret and the other coefficients uniform: any t shares determine f, any t - 1 are consistent with every
secret in equal measure.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping

from device_agent.secagg.errors import ParameterError, ProtocolViolation

PRIME = (1 << 256) + 297
SECRET_BYTES = 32
SHARE_BYTES = 33


def split(
    secret: int,
    threshold: int,
    holders: Iterable[int],
    prime: int = PRIME,
    randbelow: Callable[[int], int] = secrets.randbelow,
) -> dict[int, int]:
    """Shares {x: f(x)} of ``secret`` for each x in ``holders`` (distinct, 1 <= x < prime)."""
    xs = list(holders)
    if not 0 <= secret < prime:
        raise ParameterError("secret: outside the field")
    if threshold < 1:
        raise ParameterError(f"threshold: must be >= 1, got {threshold}")
    if len(set(xs)) != len(xs) or any(not 0 < x < prime for x in xs):
        raise ParameterError("holders: share indices must be distinct and in 1..prime-1")
    if len(xs) < threshold:
        raise ParameterError(f"threshold: {threshold} shares needed but only {len(xs)} holders")
    coefficients = [secret] + [randbelow(prime) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x, prime) for x in xs}


def combine(shares: Mapping[int, int], threshold: int, prime: int = PRIME) -> int:
    """The secret from at least ``threshold`` shares: Lagrange interpolation of f at 0 through ``threshold`` of them."""
    if len(shares) < threshold:
        raise ProtocolViolation(f"{len(shares)} shares given, {threshold} needed to reconstruct")
    points = sorted(shares.items())[:threshold]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                numerator = numerator * -xj % prime
                denominator = denominator * (xi - xj) % prime
        secret = (secret + yi * numerator * pow(denominator, -1, prime)) % prime
    return secret


def _evaluate(coefficients: list[int], x: int, prime: int) -> int:
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % prime
    return value


def secret_to_int(secret: bytes) -> int:
    if len(secret) != SECRET_BYTES:
        raise ParameterError(f"secret: {len(secret)} bytes, {SECRET_BYTES} expected")
    return int.from_bytes(secret, "big")


def int_to_secret(value: int) -> bytes:
    """The 32-byte secret a reconstructed field element stands for; a larger one means inconsistent shares."""
    if value >= 1 << (8 * SECRET_BYTES):
        raise ProtocolViolation("reconstructed value is not a 32-byte secret: the shares are inconsistent")
    return value.to_bytes(SECRET_BYTES, "big")


def share_to_bytes(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    if len(data) != SHARE_BYTES:
        raise ProtocolViolation(f"share of {len(data)} bytes, {SHARE_BYTES} expected")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise ProtocolViolation("share outside the field")
    return y
