"""What a round's close reads of its accepted uploads, and the check that a journaled upload can be closed.

An upload is journaled before it is folded and acknowledged, so a close that fails on it fails again on
every resume. The close therefore reads only numbers that the upload schema bounds
(:data:`device_agent.wire.bounds.UPLOAD_META`), and a journal written by an older release, which bounded
less, is read again through today's schema on resume (:func:`journaled_meta`): an entry that fails it
is quarantined (:meth:`coordinator.rundir.RunDir.quarantine`) instead of stopping the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from coordinator.evaluation import federated_evaluation, personalized_accuracy
from coordinator.metrics import DeviceRoundMetrics, RoundMetrics
from device_agent.protocol import ReceivedEvaluation, UploadMeta, UploadMetaError, parse_upload_meta


def round_metrics(
    round_: int,
    devices: Mapping[str, DeviceRoundMetrics],
    received: Iterable[ReceivedEvaluation | None],
    server: tuple[float, float] | None,
    seconds: float,
    phases: Mapping[str, float],
) -> RoundMetrics:
    """The round's metrics line: ``received`` from the accepted uploads, ``server`` the (accuracy, loss) here."""
    federated = federated_evaluation(received)
    return RoundMetrics(
        round=round_,
        accuracy=None if server is None else server[0],
        loss=None if server is None else server[1],
        federated_accuracy=None if federated is None else federated[0],
        federated_loss=None if federated is None else federated[1],
        personalized_accuracy=personalized_accuracy(m.local_accuracy for m in devices.values()),
        participants=sum(m.status == "accepted" for m in devices.values()),
        bytes_up=sum(m.bytes_up for m in devices.values()),
        bytes_down=sum(m.bytes_down for m in devices.values()),
        seconds=seconds,
        phases=dict(phases),
        devices=dict(devices),
    )


_RECEIVED_AS = {"accuracy": "global_accuracy", "loss": "global_loss", "samples": "eval_samples"}


def journaled_meta(journaled: Mapping[str, Any]) -> UploadMeta:
    """A journal entry's meta read through today's schema; ``UploadMetaError`` names what it no longer passes.

    The journal keeps the parsed numbers (``received`` as a mapping); they go back to the text a device
    sends, so one parser bounds both. Journals of releases that kept no seconds or loss count them as 0.
    """
    wire = {"train_seconds": "0", "loss": "0"}
    for key in ("samples", "train_seconds", "loss", "local_accuracy", "host_seconds"):
        if journaled.get(key) is not None:
            wire[key] = str(journaled[key])
    received = journaled.get("received")
    if received is not None:
        if not isinstance(received, Mapping):
            raise UploadMetaError(f"journaled received evaluation is a {type(received).__name__}, not a mapping")
        wire.update({name: str(received.get(key)) for key, name in _RECEIVED_AS.items()})
    return parse_upload_meta(wire)
