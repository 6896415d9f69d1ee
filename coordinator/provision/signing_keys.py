"""Builder 1b: one upload-signing key per device (``security.sign_uploads``), kept across re-provisioning.

A key is 32 random bytes as hex in ``kits/<device>/signing.key`` (0600): it travels in the device's
bundle, and the coordinator reads the same file from the kits. ``rotate`` replaces the named
devices' keys with their passwords.
"""

from __future__ import annotations

import secrets as random
from collections.abc import Collection

from coordinator.config.fleet import Fleet
from coordinator.provision.layout import SIGNING_KEY, Kits, private_dir
from coordinator.transport.broker.credentials import write_file
from device_agent.agent.signing import KEY_BYTES


def build_signing_keys(fleet: Fleet, kits: Kits, rotate: Collection[str] = ()) -> None:
    """Make the key of every device that has none (or is rotated); nothing when signing is off."""
    if not fleet.security.sign_uploads:
        return
    for device in fleet.devices:
        path = private_dir(kits.participant(device.id)) / SIGNING_KEY
        if not path.exists() or device.id in rotate:
            write_file(path, random.token_hex(KEY_BYTES) + "\n", 0o600)
