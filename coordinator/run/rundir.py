"""The run directory: everything a coordinator needs to survive kill -9 and resume where it stopped.

Layout::

    RUN_DIR/
      run.json                       run id, seed, last completed round  (the commit point of a round),
                                     and the sha256 of every kept round state
      fleet.yaml                     the configuration the run started with
      state/round-000007.safetensors global state after round 7 (round 0 = the initial model)
      journal/round-000008/          accepted uploads of the open round
        index.jsonl                  one line per accepted upload, with its sha256 (the commit point of an upload)
        000001.safetensors ...
      metrics.jsonl                  one validated RoundMetrics object per closed round
      quarantine/round-000008-dev3.* journaled uploads the run could not fold or close, each with its reason

Closing round r writes the state, then appends its metrics line, then rewrites run.json; only the last
step commits. Opening the directory repairs whatever a crash left between those steps (metrics lines or
journals of rounds past or before the commit, torn journal lines, temporary files), so ``resume()`` is
a plain read. It also checks digests: a round state that is truncated or altered (a bad disk, a copy cut
short) is refused by name and the run falls back to the newest kept state that verifies; a journaled
upload whose payload no longer matches its digest is dropped by name. Pure files: no FL math, no clocks
beyond timestamps for people.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from coordinator.config.checkpoints import Retention, kept_rounds
from coordinator.run.journal import JournalEntry, RoundJournal, RunDirError
from coordinator.run.metrics import RoundMetrics, round_scores
from device_agent.common.atomic import append_line, atomic_write, remove_temp_files
from device_agent.common.validation import describe
from device_agent.wire.payload import PayloadDigest

FORMAT = 1
RUN_FILE = "run.json"
FLEET_FILE = "fleet.yaml"
METRICS_FILE = "metrics.jsonl"
STATE_DIR = "state"
JOURNAL_DIR = "journal"
QUARANTINE_DIR = "quarantine"
LOCK_FILE = ".lock"
# The engine's record of the open round's participants; stale once the run rolls back past it.
OPEN_ROUND_FILE = "open-round.json"
NORM_HISTORY_FILE = "norm-history.json"

log = logging.getLogger("fedfleet.rundir")


class RoundNotOpen(RunDirError):
    """An upload for a round that is already closed (late) or not started; answer it, do not journal it."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a (re)started coordinator continues: fold ``journal`` into round ``next_round``'s aggregate."""

    run_id: str
    seed: int
    last_completed_round: int
    state: dict[str, torch.Tensor]
    journal: list[JournalEntry]

    @property
    def next_round(self) -> int:
        return self.last_completed_round + 1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tensor_bytes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    return save_tensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata)


def _yaml_diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Key paths where two parsed YAML documents differ, so the refusal says what changed."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in new:
                out.append(f"{where} (removed)")
            elif key not in old:
                out.append(f"{where} (added)")
            else:
                out += _yaml_diff(old[key], new[key], where)
        return out
    if old != new:
        return [f"{path or '<document>'}: {old!r} -> {new!r}"]
    return []


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RunDirError(f"{path}: not valid YAML: {exc}") from None


def read_run_file(file: Path) -> dict[str, Any]:
    """``run.json``, checked: run id, seed and the last completed round (the commit point)."""
    try:
        run = json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise RunDirError(f"{file} does not exist; this is not a fedfleet run directory") from None
    except json.JSONDecodeError as exc:
        raise RunDirError(f"{file} line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(run, dict):
        raise RunDirError(f"{file}: expected a JSON object")
    for key, kind in (("run_id", str), ("seed", int), ("last_completed_round", int)):
        if not isinstance(run.get(key), kind):
            raise RunDirError(f"{file}: '{key}' is missing or not a {kind.__name__}")
    if run.get("format") != FORMAT:
        raise RunDirError(f"{file}: format {run.get('format')!r} is not supported (expected {FORMAT})")
    return run


def latest_unfinished(runs: Path, fleet: str, rounds: int) -> Path | None:
    """The fleet's newest run under ``runs`` (``<fleet>-<time>``) if it stopped before ``rounds``, else None.

    Only the newest counts: an older run left unfinished is not picked up behind the user's back."""
    newest = max(runs.glob(f"{fleet}-*/{RUN_FILE}"), default=None)
    if newest is None:
        return None
    try:
        done = read_run_file(newest)["last_completed_round"]
    except RunDirError:
        return None
    return newest.parent if done < rounds else None


def read_metrics(path: Path) -> list[RoundMetrics]:
    """Parse and validate ``metrics.jsonl``; a bad line is reported as ``file line N: problem``."""
    path = Path(path)
    rows = []
    lines = path.read_text().splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(RoundMetrics.model_validate_json(line))
        except ValidationError as exc:
            if number == len(lines) and not line.endswith("\n"):
                break  # torn by a crash mid-append: the round it belongs to was never committed
            raise RunDirError(f"{path} line {number}: {describe(exc, empty='line')}") from None
    return rows


class RunDir:
    """One run's directory, held exclusively by one coordinator process (an flock on ``.lock``).

    Create it with :meth:`create`, reopen it with :meth:`open`; use it as a context manager or call
    :meth:`close` to release the lock.
    """

    def __init__(self, path: Path, lock_fd: int, run: dict[str, Any], retention: Retention | None) -> None:
        self.path = path
        self._lock_fd = lock_fd
        self._run = run
        self._retention = retention
        self._writing = threading.Lock()  # uploads may be accepted from the transport's thread
        self._journal: RoundJournal | None = None  # the open round's, while uploads are accepted into it

    # ---- opening -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: Path,
        fleet_file: Path,
        initial_state: Mapping[str, torch.Tensor],
        seed: int,
        *,
        run_id: str | None = None,
        retention: Retention | None = None,
    ) -> RunDir:
        """Start a new run in ``path`` (absent or empty): snapshot the fleet file and the round-0 model.

        ``retention`` prunes old round states (all are kept without it; ResNet-18 is 43 MB a round).
        """
        path = Path(path)
        if path.exists() and any(path.iterdir()):
            raise RunDirError(f"{path} is not empty; open it to resume, or choose a new run directory")
        _read_yaml(Path(fleet_file))
        path.mkdir(parents=True, exist_ok=True)
        lock_fd = cls._lock(path)
        try:
            (path / STATE_DIR).mkdir()
            atomic_write(path / FLEET_FILE, Path(fleet_file).read_bytes())
            run = {
                "format": FORMAT,
                "run_id": run_id or uuid.uuid4().hex[:12],
                "seed": int(seed),
                "last_completed_round": 0,
                "created": _now(),
                "updated": _now(),
            }
            rundir = cls(path, lock_fd, run, retention)
            run["states"] = {"0": rundir._write_state(0, initial_state)}
            atomic_write(path / RUN_FILE, json.dumps(run, indent=2).encode())
        except BaseException:
            os.close(lock_fd)
            shutil.rmtree(path / STATE_DIR, ignore_errors=True)
            for name in (FLEET_FILE, LOCK_FILE):
                (path / name).unlink(missing_ok=True)
            raise
        return rundir

    @classmethod
    def open(cls, path: Path, fleet_file: Path | None = None, *, retention: Retention | None = None) -> RunDir:
        """Reopen a run to resume it, repairing what a crash left behind.

        With ``fleet_file``, refuse when it differs from the snapshot: resuming under another
        configuration would silently mix two experiments in one set of metrics.
        """
        path = Path(path)
        if not (path / RUN_FILE).is_file():
            what = "does not exist" if not path.exists() else f"has no {RUN_FILE}"
            raise RunDirError(f"run directory {path} {what}; it is not a fedfleet run")
        lock_fd = cls._lock(path)
        try:
            run = read_run_file(path / RUN_FILE)
            if fleet_file is not None:
                cls._check_snapshot(path, Path(fleet_file))
            rundir = cls(path, lock_fd, run, retention)
            rundir._recover()
        except BaseException:
            os.close(lock_fd)
            raise
        return rundir

    @staticmethod
    def _lock(path: Path) -> int:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"run directory {path} is in use by another coordinator (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        return fd

    @staticmethod
    def _check_snapshot(path: Path, fleet_file: Path) -> None:
        differences = _yaml_diff(_read_yaml(path / FLEET_FILE), _read_yaml(fleet_file))
        if differences:
            listed = "\n  ".join(differences)
            raise RunDirError(
                f"{fleet_file} differs from the snapshot this run started with ({path / FLEET_FILE}):\n  {listed}\n"
                "Resume with the original file, or start a new run directory for the new configuration."
            )

    def _recover(self) -> None:
        """Undo every step of an uncommitted round close, drop torn appends, fall back past a corrupt state."""
        for directory in (self.path, self.path / STATE_DIR, self.path / JOURNAL_DIR):
            if directory.is_dir():
                remove_temp_files(directory)
        self._fall_back_to_good_state()
        done = self.last_completed_round
        metrics = self.path / METRICS_FILE
        if metrics.exists():
            lines = metrics.read_text().splitlines(keepends=True)
            kept = [line for line in lines if line.endswith("\n") and self._metrics_round(line) <= done]
            if kept != lines:
                atomic_write(metrics, "".join(kept).encode())
        for state in (self.path / STATE_DIR).glob("round-*.safetensors"):
            if self._round_of(state) > done:
                state.unlink()
        journal_root = self.path / JOURNAL_DIR
        for journal in journal_root.glob("round-*") if journal_root.is_dir() else ():
            round_ = self._round_of(journal)
            if round_ <= done:
                shutil.rmtree(journal)
            elif round_ > done + 1:
                raise RunDirError(f"{journal} belongs to round {round_}, but only round {done + 1} can be open")
            else:
                RoundJournal(journal).repair()

    def state_problem(self, round_: int) -> str | None:
        """Why round ``round_``'s saved state cannot be used (missing, truncated, digest mismatch), or None."""
        path = self.state_path(round_)
        if not path.is_file():
            return f"{path} is missing"
        data = path.read_bytes()
        expected = self._run.get("states", {}).get(str(round_))
        if expected is not None:
            if _sha256(data) != expected:
                return f"{path} is corrupt: its sha256 does not match {self.path / RUN_FILE}"
            return None
        try:
            load_tensors(data)
        except SafetensorError as exc:
            return f"{path} is not a valid safetensors file ({exc})"
        return None

    def _fall_back_to_good_state(self) -> None:
        """Make the newest round whose state verifies the last completed one, saying what is redone."""
        done = self.last_completed_round
        problem = self.state_problem(done)
        if problem is None:
            return
        earlier = [r for r in self._kept_rounds() if r < done and self.state_problem(r) is None]
        if not earlier:
            raise RunDirError(f"{problem}, and no earlier round state is kept to resume from; start a new run")
        good = max(earlier)
        log.error(
            "%s: resuming from round %d, the last good state; rounds %d-%d run again", problem, good, good + 1, done
        )
        for journal in self._journals():
            if self._round_of(journal) > good:
                shutil.rmtree(journal)
        (self.path / OPEN_ROUND_FILE).unlink(missing_ok=True)
        states = {r: sha for r, sha in self._run.get("states", {}).items() if int(r) <= good}
        self._commit_run({**self._run, "last_completed_round": good, "states": states, "updated": _now()})

    def _kept_rounds(self) -> list[int]:
        return sorted(self._round_of(p) for p in (self.path / STATE_DIR).glob("round-*.safetensors"))

    def _journals(self) -> list[Path]:
        root = self.path / JOURNAL_DIR
        return sorted(root.glob("round-*")) if root.is_dir() else []

    def _commit_run(self, run: dict[str, Any]) -> None:
        atomic_write(self.path / RUN_FILE, json.dumps(run, indent=2).encode())
        self._run = run

    def _metrics_round(self, line: str) -> int:
        try:
            return int(json.loads(line)["round"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            file = self.path / METRICS_FILE
            raise RunDirError(f"{file}: a line has no readable 'round': {line.strip()[:80]!r}") from None

    @staticmethod
    def _round_of(path: Path) -> int:
        match = re.fullmatch(r"round-(\d+)(\.safetensors)?", path.name)
        if not match:
            raise RunDirError(f"{path}: unexpected file in the run directory")
        return int(match.group(1))

    # ---- properties ----------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self._run["run_id"]

    @property
    def seed(self) -> int:
        return self._run["seed"]

    @property
    def last_completed_round(self) -> int:
        return self._run["last_completed_round"]

    def state_path(self, round_: int) -> Path:
        return self.path / STATE_DIR / f"round-{round_:06d}.safetensors"

    def journal_path(self, round_: int) -> Path:
        return self.path / JOURNAL_DIR / f"round-{round_:06d}"

    # ---- rounds --------------------------------------------------------------------------------

    def resume(self) -> ResumePoint:
        """The last committed global state and the uploads already accepted for the next round."""
        done = self.last_completed_round
        return ResumePoint(
            run_id=self.run_id,
            seed=self.seed,
            last_completed_round=done,
            state=self.load_state(done),
            journal=RoundJournal(self.journal_path(done + 1)).entries(),
        )

    def load_state(self, round_: int) -> dict[str, torch.Tensor]:
        """A saved round state, refused by name when it is missing or fails its digest."""
        path = self.state_path(round_)
        problem = self.state_problem(round_)
        if problem is not None:
            raise RunDirError(problem)
        try:
            return load_tensors(path.read_bytes())
        except SafetensorError as exc:
            raise RunDirError(f"{path}: not a valid safetensors file ({exc})") from None

    def accept_upload(
        self,
        round_: int,
        device: str,
        transfer_id: str,
        payload: bytes | Mapping[str, torch.Tensor],
        meta: Mapping[str, Any] | None = None,
        verified: PayloadDigest | None = None,
    ) -> bool:
        """Persist an accepted upload before it is acknowledged; False if ``device`` already has one this round.

        ``payload`` is the upload's safetensors bytes as received, or its tensors. ``meta`` (JSON)
        carries what folding it needs again after a crash (ratio, samples, ...). ``verified``: the
        digest its transport already checked, journaled instead of hashing it again.
        The caller folds the upload only when this returns True, so a retransmission after a lost ack
        is never counted twice. Raises :class:`RoundNotOpen` for an upload that arrives after its round closed.
        """
        with self._writing:
            if round_ != self.last_completed_round + 1:
                done = self.last_completed_round
                raise RoundNotOpen(f"round {round_} is not open (last completed round is {done})")
            data = payload if isinstance(payload, bytes) else _tensor_bytes(payload)
            if self._journal is None or self._journal.path != self.journal_path(round_):
                self._journal = RoundJournal(self.journal_path(round_))  # kept: it knows what it appended
            return self._journal.accept(round_, device, transfer_id, data, meta, verified)

    def journal_entries(self, round_: int) -> list[JournalEntry]:
        """The uploads accepted into ``round_`` so far, in journal order."""
        return RoundJournal(self.journal_path(round_)).entries()

    def load_upload(self, entry: JournalEntry) -> dict[str, torch.Tensor]:
        """An accepted upload's tensors, refusing a file whose digest no longer matches the journal."""
        return RoundJournal.load(entry)

    def upload_data(self, entry: JournalEntry) -> bytes:
        """An accepted upload's bytes (safetensors), refusing a file whose digest no longer matches the journal."""
        return RoundJournal.data(entry)

    def quarantine(self, entry: JournalEntry, reason: str) -> Path:
        """Take an accepted upload out of the open round's journal, keeping it and ``reason`` in ``quarantine/``.

        For an upload that a resume cannot fold or close (a journal of a release that checked less): the
        run goes on without it, and the evidence stays for a person. Returns the reason file's path.
        """
        with self._writing:
            self._journal = None  # its index loses a line: read it again
            return RoundJournal(entry.path.parent).quarantine(entry, self.path / QUARANTINE_DIR, reason, _now())

    def save_participants(self, round_: int, participants: Mapping[str, float], population: int | None = None) -> None:
        """Who takes part in ``round_`` at which level, written before any assignment leaves.

        A restart re-opens the same round with the same devices (their journaled updates still count).
        ``population``: how many devices they were drawn from (the privacy accountant's n), kept for the restart.
        """
        record = {"round": round_, "participants": dict(participants), "population": population}
        atomic_write(self.path / OPEN_ROUND_FILE, json.dumps(record).encode())

    def save_norm_history(
        self,
        round_: int,
        window: list[dict[str, list[float]]],
        records: dict[str, list[float]] | None = None,
        peaks: dict[str, float] | None = None,
    ) -> None:
        """The upload gate's accepted update norms as of ``round_``'s close, written before the round commits, each
        layer's highest median of the run (:meth:`~coordinator.algorithms.robust.NormHistory.peaks`) and the peer
        check's device records (:class:`~coordinator.algorithms.robust.PeerHistory`).

        A resumed run bounds updates by the fleet's recent median again, not by the warm-up bound: without
        it a reversed update receipted right after a restart was folded at up to the weights' own norm. Without the
        peaks a converged run's bound would fall to its collapsed median and clip honest devices; without the
        records a backdoor device would start again with a clean one.
        """
        saved = {"round": round_, "window": window, "records": records or {}, "peaks": peaks or {}}
        atomic_write(self.path / NORM_HISTORY_FILE, json.dumps(saved).encode())

    def _saved_gate(self) -> dict | None:
        """What :meth:`save_norm_history` wrote with the last completed round, or None (a fresh run, or it died
        before its commit)."""
        saved = self.path / NORM_HISTORY_FILE
        if not saved.exists():
            return None
        raw = json.loads(saved.read_text())
        return raw if raw.get("round") == self.last_completed_round else None

    def saved_norm_history(self) -> list[dict[str, list[float]]] | None:
        """The window saved with the last completed round, or None (a fresh run, or it died before its commit)."""
        raw = self._saved_gate()
        return None if raw is None else raw["window"]

    def saved_norm_peaks(self) -> dict[str, float] | None:
        """Each layer's highest median saved with the last completed round (:meth:`save_norm_history`), or None."""
        raw = self._saved_gate()
        return None if raw is None else raw.get("peaks", {})

    def saved_peer_records(self) -> dict[str, list[float]] | None:
        """The peer check's records saved with the last completed round (:meth:`save_norm_history`), or None."""
        raw = self._saved_gate()
        return None if raw is None else raw.get("records")

    def saved_population(self, round_: int) -> int | None:
        """The ``population`` saved with ``round_``'s participants, or None."""
        saved = self.path / OPEN_ROUND_FILE
        if not saved.exists():
            return None
        raw = json.loads(saved.read_text())
        return raw.get("population") if raw.get("round") == round_ else None

    def saved_participants(self, round_: int) -> dict[str, float] | None:
        """The participants saved for ``round_`` by :meth:`save_participants`, or None (a fresh round)."""
        saved = self.path / OPEN_ROUND_FILE
        if not saved.exists():
            return None
        raw = json.loads(saved.read_text())
        if raw.get("round") != round_:
            return None
        return {device: float(level) for device, level in raw["participants"].items()}

    def complete_round(self, round_: int, state: Mapping[str, torch.Tensor], metrics: RoundMetrics) -> None:
        """Close the open round: its new global state and metrics become durable, then its journal goes."""
        metrics = RoundMetrics.model_validate(metrics.model_dump())
        with self._writing:
            self._complete_round(round_, state, metrics)

    def _complete_round(self, round_: int, state: Mapping[str, torch.Tensor], metrics: RoundMetrics) -> None:
        if round_ != self.last_completed_round + 1 or metrics.round != round_:
            raise RunDirError(
                f"cannot complete round {round_} with metrics of round {metrics.round}: "
                f"the open round is {self.last_completed_round + 1}"
            )
        digest = self._write_state(round_, state)
        append_line(self.path / METRICS_FILE, metrics.model_dump_json())
        states = {**self._run.get("states", {}), str(round_): digest}
        keep = self._retained(states)
        states = {r: sha for r, sha in states.items() if int(r) in keep}
        self._commit_run({**self._run, "last_completed_round": round_, "states": states, "updated": _now()})
        if self.journal_path(round_).exists():
            shutil.rmtree(self.journal_path(round_))
        for old in self._kept_rounds():
            if old not in keep:
                self.state_path(old).unlink()
        (self.path / OPEN_ROUND_FILE).unlink(missing_ok=True)

    def _retained(self, states: Mapping[str, str]) -> set[int]:
        """Rounds whose states the retention setting keeps (every round without one)."""
        rounds = set(self._kept_rounds()) | {int(r) for r in states}
        if self._retention is None:
            return rounds
        accuracy = {}
        if self._retention.keep_best:
            accuracy = round_scores(self.metrics())
        return kept_rounds(rounds, accuracy, self._retention)

    def _write_state(self, round_: int, state: Mapping[str, torch.Tensor]) -> str:
        """Write one round state; returns its sha256 for run.json."""
        data = _tensor_bytes(state, {"run_id": self.run_id, "round": str(round_)})
        atomic_write(self.state_path(round_), data)
        return _sha256(data)

    def metrics(self) -> list[RoundMetrics]:
        path = self.path / METRICS_FILE
        return read_metrics(path) if path.exists() else []

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
