"""Per-device broker credentials and the password file both managed brokers read.

The hash format is mosquitto 2.0's ``$7$``: PBKDF2-HMAC-SHA512, 101 iterations, a 12-byte salt,
``$7$<iterations>$<base64 salt>$<base64 hash>``. Generating it here means no dependency on the
``mosquitto_passwd`` tool, and the amqtt fallback verifies the very same file.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from coordinator.config.logins import COORDINATOR_USER
from device_agent.common.atomic import atomic_write
from device_agent.wire.topics import check_name

_ITERATIONS = 101
_SALT_BYTES = 12


@dataclass(frozen=True)
class Credentials:
    """A broker login. For a device, ``username`` is the device name: the ACLs key on it."""

    username: str
    password: str

    def __repr__(self) -> str:  # never print a secret in a log or a traceback
        return f"Credentials(username={self.username!r}, password=***)"


def generate_credentials(devices: Iterable[str]) -> dict[str, Credentials]:
    """Fresh random passwords for the coordinator and every device (names checked as topic levels)."""
    names = [COORDINATOR_USER, *(check_name("device", d) for d in devices)]
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be unique and not {COORDINATOR_USER!r}: {sorted(names)}")
    return {name: Credentials(name, secrets.token_urlsafe(24)) for name in names}


def hash_password(password: str, salt: bytes | None = None, iterations: int = _ITERATIONS) -> str:
    salt = salt if salt is not None else os.urandom(_SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, hashed: str) -> bool:
    """Check a password against a ``$7$`` hash in constant time; any other format is refused."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[1] != "7":
        return False
    try:
        iterations = int(parts[2])
        salt = base64.b64decode(parts[3], validate=True)
        expected = base64.b64decode(parts[4], validate=True)
    except ValueError:
        return False
    return hmac.compare_digest(hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations), expected)


def write_password_file(
    path: Path, credentials: Mapping[str, Credentials], owner: tuple[int, int] | None = None
) -> None:
    """``user:$7$...`` lines, written atomically, private to us and the broker's user (see ``write_private``)."""
    text = "".join(f"{c.username}:{hash_password(c.password)}\n" for c in credentials.values())
    write_private(path, text, owner)


def read_password_file(path: Path) -> dict[str, str]:
    """user -> hash, for the amqtt fallback's authentication."""
    users = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        if not sep:
            raise ValueError(f"{path}:{number}: expected 'user:hash'")
        users[user] = hashed
    return users


def write_private(path: Path, text: str, owner: tuple[int, int] | None = None) -> None:
    """Write atomically with mode 0640, owned by ``owner`` (uid, gid) when given.

    mosquitto started as root drops to the ``mosquitto`` user before reading its password and ACL
    files, so they must belong to (or be group-readable by) that user, yet stay private to others.
    """
    write_file(path, text, 0o640, owner)


def write_file(path: Path, data: bytes | str, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Write atomically with ``mode`` (created with it, so a secret is never readable in between)."""
    atomic_write(path, data, mode, owner)
