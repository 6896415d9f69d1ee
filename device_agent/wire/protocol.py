"""The round protocol: how one FL round travels over the wire messages, and its pure helpers.

Topics are per device (``device_agent.wire.topics``); payloads are verified chunked transfers
(``device_agent.wire.transfer``); tensors are safetensors (``device_agent.wire.codec``).

1. Device connects (persistent session, last will = retained ``Status(offline)`` on ``up/status``),
   publishes ``Hello`` with its probed profile on ``up/data`` *retained* (so a restarted coordinator
   learns the fleet again when it subscribes) and a retained ``Status(idle)``. It refreshes the
   status every ``heartbeat_s``.
2. Coordinator plans ratios from profiles (measured ones override the catalog), picks the round's
   participants among online devices and, per device, sends the strategy's ``Assignment`` tensors
   as one transfer (``kind="assignment"``, ``run``, ``round``) followed by an ``Assignment`` message
   (round, deadline, ``download`` = that transfer id, the strategy's typed client ``spec`` and the
   ``train`` config; see :mod:`device_agent.clients.spec`).
3. Device trains on its local data, stores the update in its ``Outbox`` (durable), publishes it as a
   transfer with ``kind="update"``, ``run``, ``round`` and :func:`upload_meta` (samples, seconds, loss,
   the trained model's accuracy on the device's own test shard, and federated evaluation: the model
   *as received*, before training, on that same test shard). Tensors are the program's
   ``upload()`` plus ``extras()`` under :data:`EXTRA_PREFIX`.
4. Coordinator validates (sender = the topic's device, i.e. the broker-authenticated user; run;
   round; meta; the payload's header against the strategy's ``upload_contract`` for the device's slot:
   names, shapes, dtypes, before decoding; then finite and bounded values), journals it
   (``RunDir.accept_upload``), folds it, and only then answers ``Receipt(accepted)``. A
   duplicate (resend after a lost receipt) gets ``Receipt(duplicate)``, an update for a closed round
   ``Receipt(late)``, an invalid one ``Error(code="rejected")``. On any of these the device deletes it
   from its outbox; until then it resends it (after reconnects, restarts, or a new assignment for
   the same round from a restarted coordinator), each time as a fresh transfer. ``Error(rejected)``
   naming the transfer (the gate's refusal, or a coordinator of another run) also means the round is not
   done: the next assignment for it is trained again (the coordinator sends one once after a refusal; a
   resumed run re-sends its open round), while any other repeat of an assignment already trained is ignored.
5. A device that cannot train (out of memory, broken data) sends ``RoundFailed``; the coordinator
   stops waiting for it, and after an out-of-memory plans it one rank level lower. A device of a
   personalized strategy that lost the part it keeps between rounds (its state directory was wiped)
   sends reason ``state_lost``: the coordinator forgets its personalized state, so its next
   assignment is a whole model again. A payload that does not fit the model the spec builds (tensor
   names, shapes, dtypes, finite values; :mod:`device_agent.clients.assignment_check`) is never cast to fit:
   the device sends reason ``bad_assignment`` naming the offending tensors.
6. The round closes when every participant answered, when it has its quorum and the rest are past the
   laggards' grace (a multiple of this round's answer times), or at the deadline (quorum permitting).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from device_agent.wire.bounds import MAX_COUNT, UPLOAD_META

T = TypeVar("T")

EXTRA_PREFIX = "__extra__."
MAX_SAMPLES = MAX_COUNT
ASSIGNMENT_KIND = "assignment"
UPDATE_KIND = "update"


class UploadMetaError(ValueError):
    """An update whose manifest meta is missing or malformed."""


def round_seed(run_seed: int, round: int, device_index: int) -> int:
    """The seed of one device's local training in one round: distinct per device and round, reproducible per run."""
    return run_seed * 1_000_003 + round * 1_000 + device_index


def pack_upload(upload: Mapping[str, torch.Tensor], extras: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tensor dict for the wire: the strategy's upload and its side information, kept apart by name."""
    clash = [key for key in upload if key.startswith(EXTRA_PREFIX)]
    if clash:
        raise ValueError(f"upload tensor names may not start with {EXTRA_PREFIX!r}: {clash[:3]}")
    return {**upload, **{EXTRA_PREFIX + key: value for key, value in extras.items()}}


def split_upload(tensors: Mapping[str, T]) -> tuple[dict[str, T], dict[str, T]]:
    """Inverse of :func:`pack_upload`: (upload, extras); of tensors, or of what a header says of them."""
    upload = {k: v for k, v in tensors.items() if not k.startswith(EXTRA_PREFIX)}
    extras = {k.removeprefix(EXTRA_PREFIX): v for k, v in tensors.items() if k.startswith(EXTRA_PREFIX)}
    return upload, extras


@dataclass(frozen=True)
class ReceivedEvaluation:
    """Federated evaluation: the model a device received, before it trains, on its own test shard.

    Piggybacked on the upload, so it costs no extra round trip; it measures the global model of the
    round before (what the coordinator sent), not the update being uploaded.
    """

    accuracy: float
    loss: float
    samples: int


@dataclass(frozen=True)
class UploadMeta:
    """What an update's manifest meta says about the round that produced it."""

    samples: int
    train_seconds: float
    loss: float
    local_accuracy: float | None = None
    """Accuracy of the trained model on the device's own test shard: the only measure of a personalized
    model, whose private part never reaches the coordinator. None from agents that do not report it."""
    host_seconds: float | None = None
    """Of ``train_seconds``, what the host computed (an emulated device sleeps the rest); None: a real device."""
    received: ReceivedEvaluation | None = None
    """The received model on the device's test shard; None from agents without a test shard or that predate it."""


def upload_meta(
    samples: int,
    train_seconds: float,
    loss: float,
    local_accuracy: float | None = None,
    host_seconds: float | None = None,
    received: ReceivedEvaluation | None = None,
) -> dict[str, str]:
    """Manifest meta of an update (str -> str); the sender adds the payload's ``sha256``.

    ``host_seconds`` only from an emulated device: the part of ``train_seconds`` its host computed.
    """
    meta = {
        "samples": str(int(samples)),
        "train_seconds": f"{train_seconds:.6f}",
        "loss": f"{loss:.6f}",
    }
    if local_accuracy is not None:
        meta["local_accuracy"] = f"{local_accuracy:.6f}"
    if host_seconds is not None:
        meta["host_seconds"] = f"{host_seconds:.6f}"
    if received is not None:
        meta["global_accuracy"] = f"{received.accuracy:.6f}"
        meta["global_loss"] = f"{received.loss:.6f}"
        meta["eval_samples"] = str(int(received.samples))
    return meta


RECEIVED_KEYS = ("global_accuracy", "global_loss", "eval_samples")


def _number(meta: Mapping[str, str], key: str) -> float:
    """``meta[key]`` read as its kind of number and checked against its range in :data:`UPLOAD_META`."""
    bound = UPLOAD_META[key]
    try:
        value: float = int(meta[key]) if bound.integer else float(meta[key])
    except ValueError as exc:
        raise UploadMetaError(f"update manifest meta: {key}: {exc}") from None
    problem = bound.problem(key, value)
    if problem is not None:
        raise UploadMetaError(f"update manifest meta: {problem}")
    return value


def _parse_received(meta: Mapping[str, str]) -> ReceivedEvaluation | None:
    """The federated evaluation figures of an update's meta: all three keys or none."""
    present = [key for key in RECEIVED_KEYS if key in meta]
    if not present:
        return None
    if len(present) != len(RECEIVED_KEYS):
        missing = ", ".join(key for key in RECEIVED_KEYS if key not in meta)
        raise UploadMetaError(f"update manifest meta has {', '.join(present)} but lacks {missing}")
    accuracy, loss, samples = (_number(meta, key) for key in RECEIVED_KEYS)
    return ReceivedEvaluation(accuracy, loss, int(samples))


def parse_upload_meta(meta: Mapping[str, str]) -> UploadMeta:
    """An update's meta, every number within its range (:data:`UPLOAD_META`); else ``UploadMetaError`` naming it.

    The payload's integrity is the transfer's business (its sealed manifest): one digest per upload.
    """
    missing = [key for key in ("samples", "train_seconds", "loss") if key not in meta]
    if missing:
        raise UploadMetaError(f"update manifest meta lacks {', '.join(missing)}")
    samples, seconds, loss = int(_number(meta, "samples")), _number(meta, "train_seconds"), _number(meta, "loss")
    accuracy = _number(meta, "local_accuracy") if "local_accuracy" in meta else None
    host = _number(meta, "host_seconds") if "host_seconds" in meta else None
    if host is not None and host > seconds * 1.01 + 1e-3:
        raise UploadMetaError(f"update manifest meta: host_seconds={host} is not in [0, train_seconds={seconds}]")
    return UploadMeta(samples, seconds, loss, accuracy, host, _parse_received(meta))
