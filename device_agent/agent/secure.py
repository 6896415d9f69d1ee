"""Secure aggregation in the agent: answers a round's SecAgg+ messages and sends its update masked, never plain.

The coordinator runs a round's key exchange (``Setup``, keys, shares: :mod:`device_agent.secagg`) before it sends
the round's assignment, so the agent knows before training that this round's update must not leave in the clear.
The runtime hands every :class:`~device_agent.wire.messages.SecAgg` message to :class:`SecureRounds` and,
after training such a round, its update (trained minus received, every trainable float tensor in key order)
instead of uploading it. The masked input, the size of the model, travels as a payload of kind
:data:`MASKED_KIND`; the other protocol messages are small and travel as control messages.

A round's protocol that fails on this device (a message out of order, a signature that does not verify) only
makes it a dropout: the coordinator's protocol carries on without it. Nothing is kept on disk: a device that
restarts mid-protocol has dropped out of that run of it, and a coordinator that restarts opens a new run (a new
session ``attempt``), which masks the same update afresh.
"""

from __future__ import annotations

import base64
import binascii
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor

from device_agent.clients.base import is_norm_statistic
from device_agent.layers.factorized import reconstruct
from device_agent.secagg import DeviceProtocol, SecAggError
from device_agent.secagg.auth import HmacAuth
from device_agent.secagg.errors import ProtocolViolation
from device_agent.secagg.messages import (
    ForwardedShares,
    Message,
    NeighbourKeys,
    Session,
    Setup,
    UnmaskRequest,
    decode,
    encode,
)
from device_agent.wire.messages import SecAgg
from device_agent.wire.protocol import split_upload

log = logging.getLogger("fedfleet.agent")

CLAMPED_VALUES = 1
"""Values a masked vector has past its update: the device's fraction of clamped values (times clip), summed."""
MASKED_KIND = "secagg_masked"
"""The payload kind of a masked input (a ``MaskedInput`` in its wire form); the engine never decodes it as an update."""


def wrap(
    run: str,
    round_: int,
    message: Message,
    weight: float | None = None,
    layout: Layout | None = None,
    noise: float | None = None,
) -> SecAgg:
    """A protocol message as the control message that carries it (``weight``, ``layout``, ``noise``: see
    :class:`SecAgg`)."""
    body = base64.b64encode(encode(message)).decode()
    raw = None if layout is None else layout.model_dump(mode="json")
    return SecAgg(run=run, round=round_, body=body, weight=weight, layout=raw, noise=noise)


def unwrap(message: SecAgg) -> Message:
    """The protocol message a :class:`SecAgg` carries; ``ProtocolViolation`` if it is not one."""
    try:
        data = base64.b64decode(message.body, validate=True)
    except binascii.Error as exc:
        raise ProtocolViolation(f"secure-aggregation message body is not base64: {exc}") from None
    return decode(data)


def vector_keys(sent: Mapping[str, Tensor]) -> list[str]:
    """The tensors a masked update covers: every trainable float tensor of what was sent, in key order."""
    return sorted(key for key, value in sent.items() if value.is_floating_point() and not is_norm_statistic(key))


def update_vector(sent: Mapping[str, Tensor], trained: Mapping[str, Tensor]) -> np.ndarray:
    """The round's update as one flat float64 vector: trained minus sent over :func:`vector_keys`."""
    parts = [(trained[key].double() - sent[key].double()).reshape(-1).numpy() for key in vector_keys(sent)]
    return np.concatenate(parts) if parts else np.zeros(0)


class Entry(BaseModel):
    """One tensor of the summed vector: the global model's ``key`` (``shape``), taken from this device's update.

    ``index``: the kept positions along each dimension (None: all) where the device's smaller tensor goes, zeros
    elsewhere (HeteroFL and FedRolex width slices). ``factors``: the (reduce, expand) keys of a low-rank layer whose
    dense product is taken, trained minus sent (FedHM). ``count``: the entry carries ``clip`` wherever this device
    holds the tensor (so the sum counts the holders per value, which the classes below make private).
    ``by_class``: rows (dim 0) of classes the device has no data of are zero (a label-masked classifier).
    ``scale``: the value is multiplied by it (a LoRA factor B or product B A in effective form, times alpha / r).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    shape: tuple[int, ...]
    index: tuple[tuple[int, ...] | None, ...] | None = None
    factors: tuple[str, str] | None = None
    count: bool = False
    by_class: bool = False
    scale: float = 1.0


class Layout(BaseModel):
    """Where each part of a device's update goes in the vector every device of the round masks the same way."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    entries: tuple[Entry, ...]

    @property
    def length(self) -> int:
        return sum(int(np.prod(entry.shape)) for entry in self.entries)


def layout_vector(layout: Layout, sent: Mapping[str, Tensor], upload: Mapping[str, Tensor], clip: float) -> np.ndarray:
    """This device's update in ``layout``'s form, one flat float64 vector (before its weight)."""
    trained, extras = split_upload(upload)
    classes = extras.get("classes")
    parts = []
    for entry in layout.entries:
        if entry.factors is not None:
            reduce, expand = entry.factors
            value = reconstruct(trained[reduce].double(), trained[expand].double(), entry.shape) - reconstruct(
                sent[reduce].double(), sent[expand].double(), entry.shape
            )
        elif entry.count:
            value = torch.full(sent[entry.key].shape, clip, dtype=torch.float64)
        else:
            value = trained[entry.key].double() - sent[entry.key].double()
        if entry.scale != 1.0:
            value = value * entry.scale
        if entry.by_class:
            if classes is None:
                raise ProtocolViolation(f"{entry.key!r}: a label-masked layout needs this device's classes")
            present = torch.zeros(value.shape[0], dtype=torch.bool)
            present[classes.long()] = True
            value = value * present.view((-1,) + (1,) * (value.dim() - 1))
        parts.append(place(entry, value).reshape(-1).numpy())
    return np.concatenate(parts) if parts else np.zeros(0)


def place(entry: Entry, value: Tensor) -> Tensor:
    """``value`` (this device's tensor) where ``entry`` puts it in the full tensor, zeros elsewhere."""
    if entry.index is None:
        if tuple(value.shape) != entry.shape:
            raise ProtocolViolation(f"{entry.key!r}: shape {tuple(value.shape)}, the layout says {entry.shape}")
        return value
    if len(entry.index) != len(entry.shape) or len(entry.index) != value.dim():
        raise ProtocolViolation(f"{entry.key!r}: shape {tuple(value.shape)} does not fit the layout's index")
    kept = [torch.arange(n) if ix is None else torch.tensor(ix) for ix, n in zip(entry.index, entry.shape, strict=True)]
    if tuple(len(k) for k in kept) != tuple(value.shape):
        raise ProtocolViolation(f"{entry.key!r}: shape {tuple(value.shape)} does not fit the layout's index")
    full = torch.zeros(entry.shape, dtype=torch.float64)
    full[torch.meshgrid(*kept, indexing="ij")] = value
    return full


@dataclass
class _Run:
    """One run of the protocol on this device: its state machine, and what masking waits for."""

    protocol: DeviceProtocol
    session: Session
    clip: float
    weight: float
    layout: Layout | None = None
    noise: float | None = None
    """The std of the Gaussian noise added to each value before masking (privacy), None: none."""
    update: np.ndarray | None = None
    forwarded: ForwardedShares | None = None
    masked: bool = False


class SecureRounds:
    """This device's runs of the protocol, one per (run, round); ``send`` publishes, ``upload`` sends a payload."""

    def __init__(
        self,
        device: str,
        key: bytes | None,
        send: Callable[[SecAgg], None],
        upload: Callable[[str, int, bytes], None],
    ) -> None:
        self.device = device
        self._auth = None if key is None else HmacAuth({device: key})
        self._send, self._upload = send, upload
        self._runs: dict[tuple[str, int], _Run] = {}
        self._updates: dict[tuple[str, int], np.ndarray] = {}
        """Updates trained under secure aggregation, kept for a protocol restarted by a restarted coordinator."""

    def expects(self, run: str, round_: int) -> bool:
        """Whether the coordinator opened secure aggregation for this round: its update goes masked."""
        return (run, round_) in self._runs

    def on_message(self, message: SecAgg) -> None:
        key = (message.run, message.round)
        try:
            inner = unwrap(message)
            if isinstance(inner, Setup):
                earlier = self._runs.get(key)
                if earlier is not None and earlier.session == inner.session:
                    return  # redelivered: answered already (fresh keys now would contradict that answer)
                self._forget_before(message.run, message.round)
                protocol = DeviceProtocol(self.device, self._auth)
                weight = 1.0 if message.weight is None else message.weight
                clip = inner.params.clip
                layout = None if message.layout is None else _layout(message.layout)
                state = self._runs[key] = _Run(
                    protocol, inner.session, clip, weight, layout, message.noise, self._updates.get(key)
                )
                self._send(wrap(*key, state.protocol.advertise(inner)))
                return
            state = self._runs.get(key)
            if state is None:
                log.info("%s: %s of round %d, not open here: ignored", self.device, inner.KIND, key[1])
                return
            if isinstance(inner, NeighbourKeys):
                self._send(wrap(*key, state.protocol.share_keys(inner)))
            elif isinstance(inner, ForwardedShares):
                state.forwarded = inner
                self._mask(key, state)
            elif isinstance(inner, UnmaskRequest):
                self._send(wrap(*key, state.protocol.unmask(inner)))
            else:
                raise ProtocolViolation(f"{inner.KIND} is a device's message, not the coordinator's")
        except SecAggError as exc:
            # This device drops out of the run: the coordinator's protocol goes on without it.
            log.warning("%s: round %d secure aggregation: %s", self.device, key[1], exc)
            self._runs.pop(key, None)

    def vector(self, run: str, round_: int, sent: Mapping[str, Tensor], upload: Mapping[str, Tensor]) -> np.ndarray:
        """The round's update as the vector this round masks: in the setup's layout, else trained minus sent."""
        state = self._runs.get((run, round_))
        if state is None or state.layout is None:
            return update_vector(sent, upload)
        return layout_vector(state.layout, sent, upload, state.clip)

    def trained(self, run: str, round_: int, update: np.ndarray) -> None:
        """The round's update is ready: it is masked as soon as the neighbours' shares are here."""
        key = (run, round_)
        self._updates = {key: update}  # only the newest round's: an older one is never asked for again
        state = self._runs.get(key)
        if state is not None:
            state.update = update
            try:
                self._mask(key, state)
            except SecAggError as exc:
                log.warning("%s: round %d secure aggregation: %s", self.device, round_, exc)
                self._runs.pop(key, None)

    def _mask(self, key: tuple[str, int], state: _Run) -> None:
        if state.masked or state.forwarded is None or state.update is None:
            return
        update = state.update
        if state.noise is not None:  # this device's share of the round's DP noise, fresh for every run of the protocol
            update = update + np.random.default_rng(secrets.randbits(128)).normal(0.0, state.noise, update.shape)
        update = update * state.weight  # the sum of weighted updates, divided by the weights' sum at the end
        clamped = int(np.sum(np.abs(update) > state.clip))
        if clamped:  # the sum then differs from the plain one by more than the quantization error: say so
            log.warning(
                "%s: round %d: %d of %d update values outside [-%g, %g] clamped before masking",
                self.device,
                key[1],
                clamped,
                update.size,
                state.clip,
                state.clip,
            )
        # One more value: this device's clamped fraction x clip, so the sum tells the round's mean (no one's own).
        update = np.append(update, clamped / max(1, update.size) * state.clip)
        masked = state.protocol.mask(state.forwarded, update, clip=True)
        state.masked, state.update = True, None
        self._upload(*key, encode(masked))

    def _forget_before(self, run: str, round_: int) -> None:
        for key in [k for k in self._runs if k[0] != run or k[1] < round_]:
            del self._runs[key]


def _layout(raw: Mapping[str, object]) -> Layout:
    try:
        return Layout.model_validate(raw)
    except ValidationError as exc:
        raise ProtocolViolation(f"the setup's layout is malformed: {exc.errors()[0]['msg']}") from None


__all__ = [
    "CLAMPED_VALUES",
    "MASKED_KIND",
    "Entry",
    "Layout",
    "SecureRounds",
    "layout_vector",
    "place",
    "unwrap",
    "update_vector",
    "vector_keys",
    "wrap",
]
