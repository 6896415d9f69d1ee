"""The upload gate as one object: it admits an upload into the open round, or refuses it with a reason.

In order: envelope (kind, run, round, participant, duplicate) -> signature -> the update's meta
(samples, finite seconds and loss, accuracies in [0, 1]) -> decode -> the strategy's checks for that
slot (names, shapes, dtypes, finite values, magnitude) -> journal -> fold. Nothing touches the
aggregate before the journal has the upload, so a refused or late upload never counts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.rounds.signing import UploadSignatures
from coordinator.rounds.state import OpenRound
from coordinator.rounds.upload_gate import UploadGate, UploadRefused, check_dtypes, squared_norms
from coordinator.run.journal import JournalEntry
from coordinator.run.rundir import RoundNotOpen, RunDir
from device_agent.wire.codec import CodecError, decode_tensors
from device_agent.wire.protocol import UPDATE_KIND, ReceivedEvaluation, split_upload
from device_agent.wire.transfer import Completed

log = logging.getLogger("fedfleet.engine")


class Admission:
    """Admits uploads into the open round; ``expected_samples(device)`` bounds what a device may claim."""

    def __init__(
        self,
        gate: UploadGate,
        rundir: RunDir,
        expected_samples: Callable[[str], int],
        signatures: UploadSignatures | None = None,
    ) -> None:
        self.gate = gate
        self.rundir = rundir
        self.expected_samples = expected_samples
        self.signatures = signatures

    def admit(self, device: str, completed: Completed, open_: OpenRound | None, next_round: int) -> str:
        """The receipt status (accepted, duplicate, late), or raises why the update is refused."""
        manifest = completed.manifest
        if manifest.kind != UPDATE_KIND:
            raise UploadRefused("wrong_kind", f"expected a transfer of kind {UPDATE_KIND!r}, got {manifest.kind!r}")
        if manifest.run != self.rundir.run_id:
            raise UploadRefused("wrong_run", f"update for run {manifest.run!r}, but this run is {self.rundir.run_id!r}")
        if open_ is None or manifest.round < open_.round:
            if manifest.round < next_round:
                return "late"
            raise UploadRefused("wrong_round", f"round {manifest.round} is not open")
        if manifest.round != open_.round:
            raise UploadRefused("wrong_round", f"round {manifest.round} is not open (the open round is {open_.round})")
        participant = open_.participants.get(device)
        if participant is None:
            raise UploadRefused("not_participant", f"{device!r} is not a participant of round {open_.round}")
        if participant.status == "accepted":
            return "duplicate"
        data = completed.data
        if self.signatures is not None:
            self.signatures.check(device, manifest)
        parsed = self.gate.meta(manifest.meta, self.expected_samples(device))
        try:
            tensors = decode_tensors(data)
            check_dtypes(tensors)
            upload, extras = split_upload(tensors)
            open_.aggregate.check(device, upload, parsed.samples, extras)
            norm = self.gate.norm(device, participant.level, upload)
        except (UpdateRejected, CodecError):
            raise
        except Exception as exc:  # one device's bytes must never stop the engine, whatever they trip over
            raise UploadRefused("other", f"the update could not be checked: {type(exc).__name__}: {exc}") from exc
        meta = {
            "samples": parsed.samples,
            "train_seconds": parsed.train_seconds,
            "host_seconds": parsed.host_seconds,
            "loss": parsed.loss,
            "level": participant.level,
            "payload_bytes": len(data),
            "local_accuracy": parsed.local_accuracy,
            "received": None if parsed.received is None else asdict(parsed.received),
        }
        try:
            verified = None if manifest.digest is None else (manifest.digest, manifest.chunk_size)
            self.rundir.accept_upload(open_.round, device, manifest.transfer, data, meta, verified)
        except RoundNotOpen:
            return "late"
        open_.aggregate.fold(device, upload, parsed.samples, extras)
        self.gate.accepted(participant.level, norm)
        participant.status, participant.payload_bytes = "accepted", len(data)
        participant.train_seconds, participant.local_accuracy = parsed.train_seconds, parsed.local_accuracy
        participant.host_seconds, participant.received = parsed.host_seconds, parsed.received
        return "accepted"

    def replay(self, journal: Sequence[JournalEntry], open_: OpenRound) -> None:
        """Fold the uploads accepted before a restart back into the re-opened round."""
        for entry in journal:
            if entry.round != open_.round or entry.device not in open_.participants:
                continue
            upload, extras = split_upload(self.rundir.load_upload(entry))
            open_.aggregate.check(entry.device, upload, int(entry.meta["samples"]), extras)
            open_.aggregate.fold(entry.device, upload, int(entry.meta["samples"]), extras)
            participant = open_.participants[entry.device]
            self.gate.accepted(participant.level, math.sqrt(sum(squared_norms(upload).values())))
            participant.status = "accepted"
            participant.train_seconds = float(entry.meta.get("train_seconds", 0.0))
            participant.host_seconds = entry.meta.get("host_seconds")
            participant.payload_bytes = int(entry.meta.get("payload_bytes", 0))
            participant.local_accuracy = entry.meta.get("local_accuracy")
            received = entry.meta.get("received")
            participant.received = ReceivedEvaluation(**received) if received else None
            log.info("round %d: replayed %s's journaled update", open_.round, entry.device)


__all__ = ["Admission"]
