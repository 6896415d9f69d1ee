"""The cryptography SecAgg needs, from the ``cryptography`` package (OpenSSL): X25519 key agreement, HKDF-SHA256,
ChaCha20-Poly1305 for the shares in transit and ChaCha20 as the PRG that expands a 32-byte seed into a mask.

``cryptography`` is an optional dependency of the device agent (the ``secagg`` extra): it is imported on first
use, and its absence is an ImportError that says what to install.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from device_agent.secagg.errors import ProtocolViolation

VERSION = "fedfleet-secagg-v1"
KEY_BYTES = 32
NONCE_BYTES = 12


@functools.cache
def _lib() -> SimpleNamespace:
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import x25519
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as error:
        raise ImportError(
            "secure aggregation needs the `cryptography` package: pip install 'fedfleet[secagg]' "
            "(or pip install 'cryptography>=42')"
        ) from error
    return SimpleNamespace(
        InvalidTag=InvalidTag,
        hashes=hashes,
        x25519=x25519,
        Cipher=Cipher,
        algorithms=algorithms,
        ChaCha20Poly1305=ChaCha20Poly1305,
        HKDF=HKDF,
    )


@dataclass(frozen=True)
class KeyPair:
    """An X25519 key pair as raw 32-byte strings (the private one is what gets secret-shared)."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        return cls.from_private(os.urandom(KEY_BYTES))

    @classmethod
    def from_private(cls, private: bytes) -> KeyPair:
        key = _lib().x25519.X25519PrivateKey.from_private_bytes(private)
        return cls(private, key.public_key().public_bytes_raw())


def agree(private: bytes, peer_public: bytes, purpose: str, *context: str) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 of the X25519 shared secret, bound to ``purpose`` and ``context``."""
    lib = _lib()
    try:
        peer = lib.x25519.X25519PublicKey.from_public_bytes(peer_public)
        shared = lib.x25519.X25519PrivateKey.from_private_bytes(private).exchange(peer)
    except ValueError as error:
        raise ProtocolViolation(f"key agreement failed: {error}") from None
    info = json.dumps([VERSION, purpose, *context], separators=(",", ":")).encode()
    return lib.HKDF(algorithm=lib.hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """ChaCha20-Poly1305 of ``plaintext`` under a random nonce, returned as nonce + ciphertext + tag."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + _lib().ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def unseal(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """The plaintext of ``seal``; a forged, altered or misaddressed ciphertext is a ``ProtocolViolation``."""
    lib = _lib()
    try:
        return lib.ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (lib.InvalidTag, ValueError):
        raise ProtocolViolation(
            "share ciphertext does not authenticate (altered, or not addressed to this device)"
        ) from None


def expand(seed: bytes, length: int, modulus_bits: int) -> np.ndarray:
    """``length`` uniform elements of Z_(2^k) from a 32-byte seed: the ChaCha20 keystream (zero nonce) cut into words.

    The same seed always gives the same mask, which is what lets the coordinator remove it; a seed is used for
    one mask only (every round draws fresh keys and seeds).
    """
    lib = _lib()
    width = 4 if modulus_bits <= 32 else 8
    encryptor = lib.Cipher(lib.algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    stream = encryptor.update(bytes(length * width))
    words = np.frombuffer(stream, dtype="<u4" if width == 4 else "<u8").astype(np.uint64)
    return words & np.uint64((1 << modulus_bits) - 1) if modulus_bits < 64 else words
