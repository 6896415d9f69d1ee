"""The coordinator's side of upload signing: each device's key from the kits, and the check the upload gate calls.

With ``security.sign_uploads`` every update must carry its device's HMAC (see
:mod:`device_agent.agent.signing`); the engine calls :meth:`UploadSignatures.check` before it parses,
decodes or journals anything, so a forged or replayed update never reaches the run.
"""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.fleet import Fleet
from coordinator.provision.layout import SIGNING_KEY, Kits
from device_agent.agent.signing import SignatureError, UploadIdentity, parse_key, verify
from device_agent.wire.payload import Received


class SignatureRefused(UpdateRejected):
    """An update refused by its signature.

    ``reason``: ``unsigned``, ``bad_signature``, ``outdated_signature`` or ``replayed``.
    """

    def __init__(self, error: SignatureError) -> None:
        super().__init__(str(error))
        self.reason = error.reason


class UploadSignatures:
    """Every device's key, and the check that an update was signed with it for this very upload."""

    def __init__(self, fleet: str, keys: Mapping[str, bytes]) -> None:
        self.fleet = fleet
        self._keys = dict(keys)

    @property
    def keys(self) -> Mapping[str, bytes]:
        """Every device's key: secure aggregation's messages are signed with it too."""
        return self._keys

    def check(self, device: str, received: Received) -> None:
        """Return if ``received`` is signed as ``device``'s update of its run, round and transfer.

        Its transport verified the bytes against its digest as they arrived, so the digest stands for
        the payload's bytes and nothing is hashed again here.
        """
        if received.digest is None:
            raise SignatureRefused(SignatureError("bad_signature", "an unsealed transfer carries no digest to verify"))
        key = self._keys.get(device)
        if key is None:
            raise SignatureRefused(SignatureError("bad_signature", f"no signing key for {device} in the kits"))
        identity = UploadIdentity(
            self.fleet, received.run, received.round, device, received.transfer, received.digest.value
        )
        try:
            verify(key, received.meta, identity)
        except SignatureError as exc:
            raise SignatureRefused(exc) from None


def upload_signatures(fleet: Fleet, kits: Kits) -> UploadSignatures | None:
    """The fleet's upload check, or None when fleet.yaml does not ask for signed uploads.

    A device without a readable key is an error naming the file: provisioning makes them.
    """
    if not fleet.security.sign_uploads:
        return None
    keys = {}
    for device in fleet.devices:
        path = kits.participant(device.id) / SIGNING_KEY
        try:
            keys[device.id] = parse_key(path.read_text(), str(path))
        except OSError:
            raise ValueError(
                f"security.sign_uploads: {path} is missing; run coordinator provision to make the devices' keys"
            ) from None
    return UploadSignatures(fleet.fleet, keys)
