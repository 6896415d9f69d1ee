"""The coordinator's side of SecAgg+: collects each stage's messages, closes the stage when told, no I/O.

    server = ServerProtocol(session, params, auth)
    send(server.start())                  # a Setup for every participant
    while server.result is None:
        for message in arrivals_until_deadline_or(server.pending()):
            server.receive(message)
        send(server.advance())            # close the stage: who did not answer has dropped out

Dropouts are handled at every stage. Before masked input, a device that stops answering is left out (no one
masks against it); one whose neighbours drop until fewer than ``threshold`` of them hold its shares is left
out too, since its secrets could not be recovered. After masked input, a survivor's self-mask is removed
with its seed, rebuilt from ``threshold`` neighbours' shares, and a dropped device's pairwise masks with its
surviving neighbours are removed with its mask key, rebuilt the same way; no device is asked for both of one
device's shares. Masked inputs are folded into one running sum on arrival: the server never holds a single
device's unmasked input, only the sum of at least ``threshold`` survivors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

import numpy as np

from device_agent.secagg import crypto, shamir
from device_agent.secagg.auth import Authenticator, check, signed
from device_agent.secagg.device import SEALED_BYTES, pair_seed, pair_sign
from device_agent.secagg.errors import ProtocolAborted, ProtocolViolation
from device_agent.secagg.graph import components
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
from device_agent.secagg.quantize import from_bytes


class ServerStage(Enum):
    ADVERTISE = "advertise keys"
    SHARE_KEYS = "share keys"
    MASK = "masked input"
    UNMASK = "unmasking"
    DONE = "done"
    ABORTED = "aborted"


_EXPECTS: dict[ServerStage, type[Message]] = {
    ServerStage.ADVERTISE: AdvertiseKeys,
    ServerStage.SHARE_KEYS: EncryptedShares,
    ServerStage.MASK: MaskedInput,
    ServerStage.UNMASK: UnmaskResponse,
}


class LateMessage(ProtocolViolation):
    """A message of a stage already closed (its sender counts as dropped): log it, do not fail the round."""


@dataclass(frozen=True)
class Aggregate:
    """The protocol's outcome: the sum of the survivors' inputs (decoded floats) and who survived."""

    total: np.ndarray
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    error_bound: float
    """The largest difference, per element, between ``total`` and the survivors' exact float sum."""

    @property
    def mean(self) -> np.ndarray:
        return self.total / len(self.survivors)


class ServerProtocol:
    def __init__(self, session: Session, params: Params, auth: Authenticator | None = None) -> None:
        self.session, self.params = session, params
        self.graph = params.graph(session)
        self.stage = ServerStage.ADVERTISE
        self.result: Aggregate | None = None
        self._auth = auth
        self._expected: frozenset[str] = frozenset(params.participants)
        self._received: dict[str, Message] = {}
        self._fingerprints: dict[str, bytes] = {}
        """SHA-256 of each taken message's signed bytes: a redelivered copy is ignored, a different one refused."""
        self._keys: dict[str, AdvertiseKeys] = {}
        self._in: frozenset[str] = frozenset()  # devices still in after the last closed stage
        self._masked_sum: np.ndarray | None = None
        self._masked_from: frozenset[str] = frozenset()
        self._requests: dict[str, UnmaskRequest] = {}

    @property
    def members(self) -> frozenset[str]:
        """The devices still in after the last closed stage (all participants before the first closes)."""
        return self._in if self.stage is not ServerStage.ADVERTISE else frozenset(self.params.participants)

    def start(self) -> list[Setup]:
        return [signed(Setup(self.session, device, self.params), self._auth) for device in self.params.participants]

    def pending(self) -> frozenset[str]:
        """Devices whose message for the open stage has not arrived: the engine may close early when none are."""
        return self._expected - set(self._received)

    def receive(self, message: Message) -> None:
        """Take one device's message for the open stage (a duplicate of one already taken is ignored)."""
        expected = _EXPECTS.get(self.stage)
        if message.session != self.session:
            raise ProtocolViolation(f"{message.KIND} of session {message.session.label}, not {self.session.label}")
        if expected is None or not isinstance(message, expected):
            raise LateMessage(f"{message.KIND} from {message.device} at stage {self.stage.value}: not accepted")
        if message.device not in self._expected:
            raise ProtocolViolation(f"{message.KIND} from {message.device}, not expected at stage {self.stage.value}")
        check(message, self._auth)
        fingerprint = hashlib.sha256(message.signed_bytes()).digest()
        earlier = self._fingerprints.get(message.device)
        if earlier is not None:
            if earlier != fingerprint:
                raise ProtocolViolation(f"{message.device} sent two different {message.KIND} messages")
            return
        self._validate(message)
        if isinstance(message, MaskedInput):
            self._fold(message)
            message = MaskedInput(message.session, message.device, b"")  # never keep the masked vector itself
        self._received[message.device] = message
        self._fingerprints[message.device] = fingerprint

    def advance(self) -> list[Message]:
        """Close the open stage: the messages of the next one, or (after unmasking) ``result`` set and []."""
        closing = {
            ServerStage.ADVERTISE: self._close_advertise,
            ServerStage.SHARE_KEYS: self._close_share_keys,
            ServerStage.MASK: self._close_mask,
            ServerStage.UNMASK: self._close_unmask,
        }.get(self.stage)
        if closing is None:
            raise ProtocolViolation(f"nothing to advance at stage {self.stage.value}")
        try:
            return closing()
        except ProtocolAborted:
            self.stage, self._masked_sum = ServerStage.ABORTED, None
            raise

    def _validate(self, message: Message) -> None:
        if isinstance(message, AdvertiseKeys):
            if len(message.share_key) != crypto.KEY_BYTES or len(message.mask_key) != crypto.KEY_BYTES:
                raise ProtocolViolation(f"keys of {message.sender} are not 32-byte X25519 public keys")
        elif isinstance(message, EncryptedShares):
            addressed = {device for device, _ in message.shares}
            owed = self.graph[message.sender] & self._in
            if addressed != owed or len(message.shares) != len(owed):
                raise ProtocolViolation(f"{message.sender} sent shares to {sorted(addressed)}, not to {sorted(owed)}")
            if any(len(sealed) != SEALED_BYTES for _, sealed in message.shares):
                raise ProtocolViolation(f"a sealed share of {message.sender} is not {SEALED_BYTES} bytes")
        elif isinstance(message, UnmaskResponse):
            request = self._requests[message.sender]
            keys = tuple(device for device, _ in message.key_shares)
            seeds = tuple(device for device, _ in message.seed_shares)
            if keys != request.dropped or seeds != request.survivors:
                raise ProtocolViolation(f"{message.sender}'s unmask response does not answer its request")

    def _fold(self, message: MaskedInput) -> None:
        vector = from_bytes(message.masked, self.params.quantizer.modulus_bits, self.params.length)
        self._masked_sum = vector if self._masked_sum is None else self._masked_sum + vector

    def _next(self, stage: ServerStage, expected: Iterable[str]) -> None:
        self.stage, self._expected, self._received, self._fingerprints = stage, frozenset(expected), {}, {}

    def _close_advertise(self) -> list[Message]:
        self._keys = {device: message for device, message in self._received.items()}  # type: ignore[misc]
        self._in = self._prune(frozenset(self._keys), ServerStage.ADVERTISE, "advertised keys")
        self._next(ServerStage.SHARE_KEYS, self._in)
        out: list[Message] = []
        for device in sorted(self._in):
            keys = tuple(
                (peer, self._keys[peer].share_key, self._keys[peer].mask_key)
                for peer in sorted(self.graph[device] & self._in)
            )
            out.append(signed(NeighbourKeys(self.session, device, keys), self._auth))
        return out

    def _close_share_keys(self) -> list[Message]:
        shares: dict[str, EncryptedShares] = dict(self._received)  # type: ignore[arg-type]
        self._in = self._prune(frozenset(shares), ServerStage.SHARE_KEYS, "shared keys")
        self._next(ServerStage.MASK, self._in)
        out: list[Message] = []
        for device in sorted(self._in):
            forwarded = tuple(
                (sender, sealed)
                for sender in sorted(self.graph[device] & self._in)
                for recipient, sealed in shares[sender].shares
                if recipient == device
            )
            out.append(signed(ForwardedShares(self.session, device, forwarded), self._auth))
        return out

    def _close_mask(self) -> list[Message]:
        survivors = frozenset(self._received)
        if len(survivors) < self.params.threshold:
            raise ProtocolAborted(
                ServerStage.MASK.value,
                f"{len(survivors)} devices sent masked input, fewer than the threshold {self.params.threshold}",
            )
        # Pairwise masks cancel only within a connected group of survivors: were they split, a coordinator that
        # kept the masked inputs could sum each group apart after unmasking, and learn more than the total.
        groups = components(self.graph, survivors)
        if len(groups) > 1:
            raise ProtocolAborted(
                ServerStage.MASK.value,
                f"the {len(survivors)} devices that sent masked input fall into {len(groups)} groups with no "
                f"neighbours in common (sizes {[len(g) for g in groups]}): unmasking would reveal each group's sum",
            )
        dropped = self._in - survivors
        # Who must be unmasked (every survivor; every dropped device a survivor masked against) needs
        # `threshold` surviving neighbours to answer: if some cannot have them, stop now, not a stage later.
        for device in sorted(survivors | {d for d in dropped if self.graph[d] & survivors}):
            self._need(device, self.graph[device] & survivors, ServerStage.MASK, "sent masked input")
        self._masked_from = survivors
        self._next(ServerStage.UNMASK, survivors)
        self._requests = {
            device: UnmaskRequest(
                self.session,
                device,
                dropped=tuple(sorted(self.graph[device] & dropped)),
                survivors=tuple(sorted(self.graph[device] & survivors)),
            )
            for device in sorted(survivors)
        }
        return [signed(request, self._auth) for request in self._requests.values()]

    def _close_unmask(self) -> list[Message]:
        responses: dict[str, UnmaskResponse] = self._received  # type: ignore[assignment]
        survivors, dropped = self._masked_from, self._in - self._masked_from
        seed_shares = self._collect(responses, lambda response: response.seed_shares)
        key_shares = self._collect(responses, lambda response: response.key_shares)
        bits, length = self.params.quantizer.modulus_bits, self.params.length
        total = self._masked_sum
        assert total is not None
        for device in sorted(survivors):
            seed = self._reconstruct(device, seed_shares, "self-mask seed")
            total = total - crypto.expand(seed, length, bits)
        for device in sorted(d for d in dropped if self.graph[d] & survivors):
            private = self._reconstruct(device, key_shares, "mask key")
            if crypto.KeyPair.from_private(private).public != self._keys[device].mask_key:
                raise ProtocolViolation(f"the mask key rebuilt from shares does not match {device}'s advertised key")
            for peer in sorted(self.graph[device] & survivors):
                # `peer` added pair_sign(peer, device) * mask: take exactly that back out.
                seed = pair_seed(private, self._keys[peer].mask_key, self.session, peer, device)
                pairwise = crypto.expand(seed, length, bits)
                total = total - pairwise if pair_sign(peer, device) > 0 else total + pairwise
        count = len(survivors)
        self.result = Aggregate(
            total=self.params.quantizer.decode_sum(total, count),
            survivors=tuple(sorted(survivors)),
            dropped=tuple(d for d in self.params.participants if d not in survivors),
            error_bound=self.params.quantizer.error_bound(count),
        )
        self._masked_sum = None
        self._next(ServerStage.DONE, ())
        return []

    def _collect(
        self, responses: dict[str, UnmaskResponse], pick: Callable[[UnmaskResponse], tuple[tuple[str, bytes], ...]]
    ) -> dict[str, dict[int, int]]:
        """{device: {holder's index: share}} from every response."""
        shares: dict[str, dict[int, int]] = {}
        for holder, response in responses.items():
            for device, share in pick(response):
                shares.setdefault(device, {})[self.params.index(holder)] = shamir.share_from_bytes(share)
        return shares

    def _reconstruct(self, device: str, shares: dict[str, dict[int, int]], what: str) -> bytes:
        held = shares.get(device, {})
        holders = {d for d in self.params.participants if self.params.index(d) in held}
        self._need(device, holders, ServerStage.UNMASK, f"returned shares of its {what}")
        return shamir.int_to_secret(shamir.combine(held, self.params.threshold))

    def _need(self, device: str, holders: frozenset[str] | set[str], stage: ServerStage, what: str) -> None:
        if len(holders) < self.params.threshold:
            raise ProtocolAborted(
                stage.value,
                f"{len(holders)} neighbours of {device} {what}, fewer than the threshold {self.params.threshold}: "
                f"its masks cannot be removed",
                device=device,
                count=len(holders),
            )

    def _prune(self, answered: frozenset[str], stage: ServerStage, what: str) -> frozenset[str]:
        """The devices left once every one with fewer than ``threshold`` neighbours left in is itself left out.

        Before any input is masked, leaving a device out is free: no one masks against it. Its secrets need
        ``threshold`` neighbours to hold shares, so one with fewer could never be unmasked if it dropped.
        """
        members = set(answered)
        while True:
            weak = {d for d in members if len(self.graph[d] & members) < self.params.threshold}
            if not weak:
                break
            members -= weak
        if len(members) < self.params.threshold:
            raise ProtocolAborted(
                stage.value,
                f"{len(answered)} of {len(self.params.participants)} devices {what}; too few keep "
                f"{self.params.threshold} (the threshold) neighbours that did",
            )
        return frozenset(members)
