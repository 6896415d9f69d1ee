"""A device's side of SecAgg+: four calls, each answering one of the coordinator's messages, no I/O.

    device = DeviceProtocol("dev-7", auth)
    keys = device.advertise(setup)                 # fresh X25519 key pairs for this round
    shares = device.share_keys(neighbour_keys)     # Shamir shares of the mask key and self-mask seed, sealed
    masked = device.mask(forwarded_shares, update) # quantized update + self-mask + pairwise masks
    answer = device.unmask(unmask_request)         # per neighbour: its key share if it dropped, else its seed share

Each call checks that its message is for this device and this session, in order, and (with ``auth``) signed.
The device answers the unmask request once and never gives both shares of one neighbour: with its seed share
and its key share together the coordinator could strip every mask off that neighbour's input.
"""

from __future__ import annotations

import os
from enum import Enum

import numpy as np
from numpy.typing import ArrayLike

from device_agent.secagg import crypto, shamir
from device_agent.secagg.auth import Authenticator, check, signed
from device_agent.secagg.errors import ProtocolAborted, ProtocolViolation
from device_agent.secagg.messages import (
    AdvertiseKeys,
    EncryptedShares,
    ForwardedShares,
    MaskedInput,
    Message,
    NeighbourKeys,
    Params,
    Session,
    Setup,
    UnmaskRequest,
    UnmaskResponse,
)
from device_agent.secagg.quantize import to_bytes

SEALED_BYTES = crypto.NONCE_BYTES + 2 * shamir.SHARE_BYTES + 16
"""One neighbour's sealed shares: nonce, the two 33-byte shares, the Poly1305 tag."""


class DeviceStage(Enum):
    SETUP = "setup"
    SHARE_KEYS = "share keys"
    MASK = "masked input"
    UNMASK = "unmasking"
    DONE = "done"


def share_aad(session: Session, sender: str, recipient: str) -> bytes:
    """What a sealed share is bound to: it opens only as ``sender``'s share for ``recipient`` in this session."""
    return f"{session.label}|{sender}|{recipient}".encode()


def pair_seed(private: bytes, peer_public: bytes, session: Session, a: str, b: str) -> bytes:
    """The seed of the pairwise mask of ``a`` and ``b``: both derive it, and the coordinator given either's key."""
    return crypto.agree(private, peer_public, "mask", session.label, *sorted((a, b)))


def share_key(private: bytes, peer_public: bytes, session: Session, sender: str, recipient: str) -> bytes:
    """The key sealing ``sender``'s shares for ``recipient``: one key per direction, used for one message."""
    return crypto.agree(private, peer_public, "share", session.label, sender, recipient)


def pair_sign(device: str, peer: str) -> int:
    """+1 if ``device`` adds the pair's mask, -1 if it subtracts it: the ordered pair's two terms cancel in the sum."""
    return 1 if device < peer else -1


class DeviceProtocol:
    def __init__(self, device: str, auth: Authenticator | None = None) -> None:
        self.device = device
        self.stage = DeviceStage.SETUP
        self._auth = auth
        self._session: Session | None = None
        self._params: Params | None = None
        self._neighbours: frozenset[str] = frozenset()
        self._share_pair: crypto.KeyPair | None = None
        self._mask_pair: crypto.KeyPair | None = None
        self._seed: bytes | None = None
        self._peer_keys: dict[str, tuple[bytes, bytes]] = {}
        self._held: dict[str, tuple[bytes, bytes]] = {}
        """Shares this device holds for each neighbour that shared with it: (mask key share, seed share)."""

    def advertise(self, setup: Setup) -> AdvertiseKeys:
        self._receive(setup, DeviceStage.SETUP)
        if self.device not in setup.params.participants:
            raise ProtocolViolation(f"{self.device} is not among the round's participants")
        self._session, self._params = setup.session, setup.params
        self._neighbours = setup.params.graph(setup.session)[self.device]
        self._share_pair, self._mask_pair = crypto.KeyPair.generate(), crypto.KeyPair.generate()
        self.stage = DeviceStage.SHARE_KEYS
        message = AdvertiseKeys(setup.session, self.device, self._share_pair.public, self._mask_pair.public)
        return signed(message, self._auth)

    def share_keys(self, message: NeighbourKeys) -> EncryptedShares:
        self._receive(message, DeviceStage.SHARE_KEYS)
        params, session, share_pair, mask_pair = self._ready()
        peers = [device for device, _, _ in message.keys]
        self._check_peers(peers, self._neighbours, "neighbour keys")
        if len(peers) < params.threshold:
            raise ProtocolAborted(
                DeviceStage.SHARE_KEYS.value,
                f"{len(peers)} of {self.device}'s neighbours advertised keys, threshold {params.threshold}",
            )
        self._peer_keys = {device: (share_key, mask_key) for device, share_key, mask_key in message.keys}
        self._seed = os.urandom(shamir.SECRET_BYTES)
        holders = {params.index(device): device for device in peers}
        key_shares = shamir.split(shamir.secret_to_int(mask_pair.private), params.threshold, holders)
        seed_shares = shamir.split(shamir.secret_to_int(self._seed), params.threshold, holders)
        sealed = []
        for x, device in sorted(holders.items(), key=lambda item: item[1]):
            plaintext = shamir.share_to_bytes(key_shares[x]) + shamir.share_to_bytes(seed_shares[x])
            key = share_key(share_pair.private, self._peer_keys[device][0], session, self.device, device)
            sealed.append((device, crypto.seal(key, plaintext, share_aad(session, self.device, device))))
        self.stage = DeviceStage.MASK
        return signed(EncryptedShares(session, self.device, tuple(sealed)), self._auth)

    def mask(self, message: ForwardedShares, update: ArrayLike, clip: bool = False) -> MaskedInput:
        """The masked input of ``update`` (flat, ``params.length`` values in [-clip, clip]; ``clip`` clamps)."""
        self._receive(message, DeviceStage.MASK)
        params, session, share_pair, mask_pair = self._ready()
        senders = [device for device, _ in message.shares]
        self._check_peers(senders, frozenset(self._peer_keys), "forwarded shares")
        if len(senders) < params.threshold:
            raise ProtocolAborted(
                DeviceStage.MASK.value,
                f"{len(senders)} of {self.device}'s neighbours shared keys, threshold {params.threshold}",
            )
        values = np.asarray(update).reshape(-1)
        if values.size != params.length:
            raise ProtocolViolation(f"update of {values.size} values; the round's vector has {params.length}")
        held = {}
        for device, sealed in message.shares:
            key = share_key(share_pair.private, self._peer_keys[device][0], session, device, self.device)
            plaintext = crypto.unseal(key, sealed, share_aad(session, device, self.device))
            if len(plaintext) != 2 * shamir.SHARE_BYTES:
                raise ProtocolViolation(f"shares from {device} are {len(plaintext)} bytes, not two 33-byte shares")
            held[device] = (plaintext[: shamir.SHARE_BYTES], plaintext[shamir.SHARE_BYTES :])
        bits = params.quantizer.modulus_bits
        masked = params.quantizer.encode(values, clip=clip) + crypto.expand(self._seed, params.length, bits)
        for device in senders:
            seed = pair_seed(mask_pair.private, self._peer_keys[device][1], session, self.device, device)
            pairwise = crypto.expand(seed, params.length, bits)
            masked = masked + pairwise if pair_sign(self.device, device) > 0 else masked - pairwise
        self._held = held
        # Its own secrets are no longer needed: shares of them are with the neighbours.
        self._seed = self._share_pair = self._mask_pair = None
        self.stage = DeviceStage.UNMASK
        return signed(MaskedInput(session, self.device, to_bytes(masked, bits)), self._auth)

    def unmask(self, message: UnmaskRequest) -> UnmaskResponse:
        self._receive(message, DeviceStage.UNMASK)
        both = set(message.dropped) & set(message.survivors)
        if both:
            raise ProtocolViolation(
                f"asked for both the mask-key share and the seed share of {sorted(both)}: refused "
                "(together they would unmask that device's input)"
            )
        self._check_peers([*message.dropped, *message.survivors], frozenset(self._held), "unmask request")
        held, self._held = self._held, {}  # answered once: nothing is left to give a second request
        self.stage = DeviceStage.DONE
        response = UnmaskResponse(
            message.session,
            self.device,
            key_shares=tuple((device, held[device][0]) for device in message.dropped),
            seed_shares=tuple((device, held[device][1]) for device in message.survivors),
        )
        return signed(response, self._auth)

    def _receive(self, message: Message, stage: DeviceStage) -> None:
        if self.stage is not stage:
            raise ProtocolViolation(f"{message.KIND} at stage {self.stage.value}; {self.device} expects {stage.value}")
        if message.device != self.device:
            raise ProtocolViolation(f"{message.KIND} for {message.device} delivered to {self.device}")
        if self._session is not None and message.session != self._session:
            raise ProtocolViolation(f"{message.KIND} of session {message.session.label}, not {self._session.label}")
        check(message, self._auth)

    def _ready(self) -> tuple[Params, Session, crypto.KeyPair, crypto.KeyPair]:
        assert self._params and self._session and self._share_pair and self._mask_pair
        return self._params, self._session, self._share_pair, self._mask_pair

    def _check_peers(self, peers: list[str], allowed: frozenset[str], what: str) -> None:
        if len(set(peers)) != len(peers):
            raise ProtocolViolation(f"{what}: a device is listed twice")
        strangers = set(peers) - allowed
        if strangers:
            raise ProtocolViolation(f"{what}: {sorted(strangers)} are not neighbours {self.device} exchanged keys with")
