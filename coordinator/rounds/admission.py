"""The upload gate as one object: it admits an upload into the open round, or refuses it with a reason.

In order: kind -> signature (before any receipt, so a forgery is never answered ``duplicate``) ->
envelope (run, round, participant, duplicate) -> the update's meta (every number within its range of
:data:`device_agent.wire.bounds.UPLOAD_META`) -> :meth:`Admission.inspect` -> the norm bounds -> journal ->
fold. Nothing touches the aggregate before the journal has the upload, so a refused or late upload never counts.

:meth:`Admission.inspect` is the one list of checks an upload's tensors pass, live, replayed on a resume and
re-folded by the close's screening: the payload's header against the strategy's
:meth:`~coordinator.strategies.base.Strategy.upload_contract` for the device's slot (names, shapes, dtypes, side
information), before a tensor is allocated; then the values (finite, bounded, index lists in range); then what
only the round can judge (``RoundAggregate.check``: the roster, a privacy clip norm). Aggregates fold and check
none of the rest again.

A resume replays the journal through the same checks and bounds (:func:`journaled_meta`): an upload journaled by
a release that checked less, which fails them or whose fold fails, is quarantined with its reason
(:meth:`~coordinator.run.rundir.RunDir.quarantine`) instead of stopping the run on every resume.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from torch import Tensor

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.rounds.signing import UploadSignatures
from coordinator.rounds.state import OpenRound, Refusals, printable, refusal_reason
from coordinator.rounds.upload_gate import Screened, UploadGate, UploadRefused, sample_scale, squared_norms
from coordinator.run.journal import JournalEntry
from coordinator.run.rundir import RoundNotOpen, RunDir
from coordinator.strategies import ClientSlot, RoundAggregate, UploadContract
from device_agent.wire.codec import CodecError, decode_tensors, encode_tensors, header_specs
from device_agent.wire.payload import Received
from device_agent.wire.protocol import UPDATE_KIND, UploadMeta, UploadMetaError, parse_upload_meta, split_upload

log = logging.getLogger("fedfleet.engine")


def describe_steps(steps: Mapping[str, float]) -> str:
    """The clipped layers, worst first, for a log line."""
    worst = sorted(steps.items(), key=lambda item: item[1])
    shown = ", ".join(f"{name} x{step:.3g}" for name, step in worst[:3])
    return shown + (f" and {len(worst) - 3} more layers" if len(worst) > 3 else "")


class Admission:
    """Admits uploads into the open round; ``expected_samples(device)`` bounds what a device may claim."""

    def __init__(
        self,
        gate: UploadGate,
        rundir: RunDir,
        expected_samples: Callable[[str], int],
        signatures: UploadSignatures | None = None,
        refused: Refusals | None = None,
        *,
        contract: Callable[[ClientSlot], UploadContract],
        typical_samples: float | None = None,
    ) -> None:
        """``contract``: what the device of a slot uploads (``Strategy.upload_contract``); ``refused``: where
        refused uploads are counted (the engine's, which observers read); ``typical_samples``: the samples the update
        bound scales every device's reference from (:func:`~coordinator.rounds.upload_gate.sample_scale`; one number
        for the fleet, so a device with more data than the rest gets room for its longer update), else each
        device's expected samples."""
        self.typical_samples = typical_samples
        self.refused = refused if refused is not None else Refusals()
        self.gate = gate
        self.rundir = rundir
        self.expected_samples = expected_samples
        self.signatures = signatures
        self.contract = contract

    def inspect(
        self, device: str, level: float, data: bytes, samples: int, aggregate: RoundAggregate
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """The checks every upload's tensors pass (module doc), live or from the journal: (all, upload, extras)."""
        contract = self.contract(ClientSlot(device, level, self.expected_samples(device)))
        contract.check_specs(*split_upload(header_specs(data)))
        tensors = decode_tensors(data)
        upload, extras = split_upload(tensors)
        contract.check_values(upload, extras)
        aggregate.check(device, upload, samples, extras)
        return tensors, upload, extras

    def admit(self, device: str, received: Received, open_: OpenRound | None, next_round: int) -> str:
        """The receipt status (accepted, duplicate, late), or raises why the update is refused."""
        if received.kind != UPDATE_KIND:
            raise UploadRefused("wrong_kind", f"expected a transfer of kind {UPDATE_KIND!r}, got {received.kind!r}")
        if self.signatures is not None:
            self.signatures.check(device, received)
        if received.run != self.rundir.run_id:
            raise UploadRefused("wrong_run", f"update for run {received.run!r}, but this run is {self.rundir.run_id!r}")
        if open_ is None or received.round < open_.round:
            if received.round < next_round:
                return "late"
            raise UploadRefused("wrong_round", f"round {received.round} is not open")
        if received.round != open_.round:
            raise UploadRefused("wrong_round", f"round {received.round} is not open (the open round is {open_.round})")
        participant = open_.participants.get(device)
        if participant is None:
            raise UploadRefused("not_participant", f"{device!r} is not a participant of round {open_.round}")
        if participant.status == "accepted":
            return "duplicate"
        data = received.data
        parsed = self.gate.meta(received.meta, self.expected_samples(device))
        try:
            tensors, upload, extras = self.inspect(device, participant.level, data, parsed.samples, open_.aggregate)
            weight = self.gate.sample_weight(parsed.samples, self.expected_samples(device))
            scale = sample_scale(weight, self.typical_samples or self.expected_samples(device))
            screened = self.gate.norm(device, participant.level, upload, scale)
        except (UpdateRejected, CodecError):
            raise
        except Exception as exc:  # one device's bytes must never stop the engine, whatever they trip over
            raise UploadRefused("other", f"the update could not be checked: {type(exc).__name__}: {exc}") from exc
        meta = {
            "samples": weight,
            "train_seconds": parsed.train_seconds,
            "host_seconds": parsed.host_seconds,
            "loss": parsed.loss,
            "level": participant.level,
            "payload_bytes": len(data),
            "local_accuracy": parsed.local_accuracy,
            "received": None if parsed.received is None else asdict(parsed.received),
            "update_norms": screened.update_norms,
        }
        if weight != parsed.samples:
            meta["claimed_samples"] = parsed.samples
        if screened.cosine is not None:  # the direction check's measure, for an operator tuning its threshold
            meta["cosine"] = screened.cosine
        if screened.steps:  # the journal keeps what is folded, so a replay folds the same
            meta["clipped"] = screened.steps
            data = encode_tensors({**tensors, **screened.upload})
            level = logging.WARNING if min(screened.steps.values()) < 0.5 else logging.INFO  # honest ones by a bit
            log.log(level, "round %d: clipped %s's update (%s)", open_.round, device, describe_steps(screened.steps))
        try:
            # A clipped upload is journaled as folded, so its digest is not the transfer's: hashed again.
            verified = None if screened.steps else received.digest
            self.rundir.accept_upload(open_.round, device, received.transfer, data, meta, verified)
        except RoundNotOpen:
            return "late"
        open_.aggregate.fold(device, screened.upload, weight, extras)
        self.gate.accepted(participant.level, screened, device)
        participant.status, participant.payload_bytes = "accepted", len(received.data)
        participant.train_seconds, participant.local_accuracy = parsed.train_seconds, parsed.local_accuracy
        participant.host_seconds, participant.received = parsed.host_seconds, parsed.received
        participant.clipped = min(screened.steps.values()) if screened.steps else None
        return "accepted"

    def replay(
        self,
        journal: Sequence[JournalEntry],
        open_: OpenRound,
        reopen: Callable[[], RoundAggregate],
        assigned: Callable[[], Mapping[str, Mapping[str, Tensor]]] | None = None,
    ) -> None:
        """Fold the uploads accepted before a restart back into the re-opened round (module doc).

        ``reopen`` gives a fresh aggregate of the round: a fold that failed part-way leaves the
        aggregate unknown, so it starts over with the uploads folded before. ``assigned`` gives what each
        participant is sent this round: with it each replayed update's direction is measured again, so the
        peer check at the close judges it like a live one (without it, replayed updates are not judged).
        """
        folded: list[tuple[str, dict, int, dict]] = []
        sent: Mapping[str, Mapping[str, Tensor]] | None = None
        for entry in journal:
            if entry.round != open_.round or entry.device not in open_.participants:
                continue
            participant = open_.participants[entry.device]
            try:
                parsed = journaled_meta(entry.meta)
                payload_bytes = int(entry.meta.get("payload_bytes", 0))
                data = self.rundir.upload_data(entry)
                _, upload, extras = self.inspect(entry.device, participant.level, data, parsed.samples, open_.aggregate)
                scale = sample_scale(parsed.samples, self.typical_samples or self.expected_samples(entry.device))
                if assigned is not None:
                    sent = assigned() if sent is None else sent
                    screened = self.gate.replayed(entry.device, upload, sent[entry.device], scale)
                else:
                    norm = math.sqrt(sum(squared_norms(upload).values()))
                    screened = Screened(upload, norm, dict(entry.meta.get("update_norms") or {}), scale=scale)
            except Exception as exc:  # a journal of an older release: whatever it trips over, the run goes on
                self._quarantine(entry, exc)
                continue
            try:
                open_.aggregate.fold(entry.device, upload, parsed.samples, extras)
            except Exception as exc:
                self._quarantine(entry, exc)
                open_.aggregate = reopen()
                for device, kept, samples, kept_extras in folded:
                    open_.aggregate.fold(device, kept, samples, kept_extras)
                continue
            folded.append((entry.device, upload, parsed.samples, extras))
            self.gate.accepted(participant.level, screened, entry.device)
            participant.status, participant.payload_bytes = "accepted", payload_bytes
            participant.train_seconds, participant.host_seconds = parsed.train_seconds, parsed.host_seconds
            participant.local_accuracy, participant.received = parsed.local_accuracy, parsed.received
            clipped = entry.meta.get("clipped") or {}
            participant.clipped = min(map(float, clipped.values())) if clipped else None
            log.info("round %d: replayed %s's journaled update", open_.round, entry.device)

    def refuse(self, device: str, round_: int, exc: Exception, open_: OpenRound | None) -> None:
        """An upload :meth:`admit` refused: logged, counted, and its participant's round failed unless accepted."""
        reason = refusal_reason(exc)
        log.warning("rejected %s's update for round %d (%s): %s", device, round_, reason, exc)
        self.refused.upload(device, round_, reason, str(exc))
        participant = open_.participants.get(device) if open_ is not None else None
        if participant is not None and participant.status != "accepted":
            participant.reject(reason, str(exc)[:500])

    def screen_round(self, open_: OpenRound, reopen: Callable[[], RoundAggregate]) -> dict[str, str]:
        """At the close, take the updates that point against the rest of the round out of it (the gate's peer
        check): each is quarantined from the journal with its reason and the round re-folded from the journal
        without it, so a resume folds the same. Returns the devices refused, with why."""
        cosines = self.gate.peer_cosines()
        if cosines:
            ordered = sorted(cosines.values())
            log.info(
                "round %d: updates' cosines with the rest of the round: min %.3g, median %.3g, max %.3g (%d updates)",
                open_.round,
                ordered[0],
                statistics.median(ordered),
                ordered[-1],
                len(ordered),
            )
        refused = self.gate.peer_outliers()
        if not refused:
            return {}
        open_.aggregate = reopen()
        for entry in self.rundir.journal_entries(open_.round):
            participant = open_.participants.get(entry.device)
            if participant is None or participant.status != "accepted":
                continue
            if entry.device in refused:
                self.rundir.quarantine(entry, f"wrong_direction: {refused[entry.device]}")
                participant.reject("wrong_direction", f"refused at the close: {refused[entry.device]}")
                self.refused.upload(entry.device, open_.round, "wrong_direction", refused[entry.device])
                self.gate.refused_at_close(entry.device)
                log.warning(
                    "round %d: refused %s's update at the close: %s", open_.round, entry.device, refused[entry.device]
                )
                continue
            samples = journaled_meta(entry.meta).samples
            data = self.rundir.upload_data(entry)
            _, upload, extras = self.inspect(entry.device, participant.level, data, samples, open_.aggregate)
            open_.aggregate.fold(entry.device, upload, samples, extras)
        return refused

    def _quarantine(self, entry: JournalEntry, exc: Exception) -> None:
        reason = f"{refusal_reason(exc)}: {type(exc).__name__}: {printable(str(exc), 480)}"
        where = self.rundir.quarantine(entry, reason)
        log.error(
            "round %d: %s's journaled update cannot be folded or closed (%s); quarantined in %s, the round goes on "
            "without it",
            entry.round,
            entry.device,
            reason,
            where,
        )


_RECEIVED_AS = {"accuracy": "global_accuracy", "loss": "global_loss", "samples": "eval_samples"}


def journaled_meta(journaled: Mapping[str, Any]) -> UploadMeta:
    """A journal entry's meta read through today's bounds; ``UploadMetaError`` names what it no longer passes.

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


__all__ = ["Admission", "journaled_meta"]
