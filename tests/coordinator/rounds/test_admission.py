"""The upload gate as one object: a signed upload received chunk by chunk, admitted, journaled, folded.

Each received byte is hashed once on the coordinator: when its chunk is verified against the seal.
The signature and the journal reuse the transfer digest that verification established.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.rounds import admission as admission_module
from coordinator.rounds.admission import Admission
from coordinator.rounds.signing import UploadSignatures
from coordinator.rounds.state import OpenRound, Participant
from coordinator.rounds.upload_gate import UploadGate
from coordinator.run.rundir import QUARANTINE_DIR, RunDir
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.agent.signing import UploadIdentity, signed_meta
from device_agent.clients.base import is_norm_statistic
from device_agent.wire.codec import encode_tensors
from device_agent.wire.payload import PayloadDigest, Received
from device_agent.wire.protocol import UPDATE_KIND
from device_agent.wire.transfer import Completed, IncomingTransfers, make_manifest

CNN = ModelSpec("cnn", 10, 1, 8)
KEY = bytes(range(32))
CHUNK = 4096
FEDHM = build_strategy("fedhm", CNN, {}, seed=0)


def _signatures() -> UploadSignatures:
    return UploadSignatures("lab", {"pi-1": KEY})


class CountingSha256:
    """``hashlib.sha256`` that adds up how many bytes everything in the process hashed."""

    def __init__(self) -> None:
        self.bytes = 0
        self._real = hashlib.sha256

    def __call__(self, data: bytes | memoryview = b"", **kwargs: object):
        counter = self
        inner = self._real(**kwargs)  # type: ignore[arg-type]

        class _Hash:
            def update(self, more: bytes | memoryview) -> None:
                counter.bytes += len(more)
                inner.update(more)

            def __getattr__(self, name: str):
                return getattr(inner, name)

        wrapped = _Hash()
        if data:
            wrapped.update(data)
        return wrapped


def _signed_upload(tmp_path: Path) -> tuple[RunDir, OpenRound, bytes, object]:
    strategy = FEDHM
    (tmp_path / "fleet.yaml").write_text("fleet: lab\n")
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    slots = [ClientSlot("pi-1", 0.5, 100)]
    open_ = OpenRound(1, {"pi-1": Participant(0.5)}, strategy.open_round(1, slots), 1e12, 0.0)
    sent = strategy.configure(1, slots)["pi-1"].tensors
    data = encode_tensors({k: v for k, v in sent.items() if not is_norm_statistic(k)})
    manifest = make_manifest(
        data,
        CHUNK,
        run=rundir.run_id,
        round=1,
        kind=UPDATE_KIND,
        meta={"samples": "100", "train_seconds": "2.0", "loss": "0.5"},
    )
    identity = UploadIdentity("lab", rundir.run_id, 1, "pi-1", manifest.transfer, manifest.digest)  # type: ignore[arg-type]
    manifest = manifest.model_copy(update={"meta": signed_meta(manifest.meta, KEY, identity)})
    return rundir, open_, data, manifest


def test_each_received_byte_is_hashed_once_from_chunk_to_journal(tmp_path: Path, monkeypatch) -> None:
    rundir, open_, data, manifest = _signed_upload(tmp_path)
    admission = Admission(UploadGate(), rundir, lambda _d: 100, _signatures(), contract=FEDHM.upload_contract)
    counting = CountingSha256()
    monkeypatch.setattr(hashlib, "sha256", counting)

    receiver = IncomingTransfers()
    receiver.on_manifest(manifest, now=0.0)
    completed = None
    for index in range(manifest.chunk_count):
        chunk = data[index * CHUNK : (index + 1) * CHUNK]
        _, completed = receiver.on_chunk(manifest.transfer, index, chunk, bytes.fromhex(manifest.chunks[index]), 0.0)
    assert completed is not None
    verified = counting.bytes
    assert admission.admit("pi-1", Received.of(completed), open_, next_round=1) == "accepted"
    after = counting.bytes - verified

    assert len(data) <= verified < len(data) + 64 * (manifest.chunk_count + 2)  # chunks, then the digest list
    assert after < 1024, f"admission hashed {after} more bytes of a {len(data)}-byte upload"
    assert open_.participants["pi-1"].status == "accepted"

    monkeypatch.setattr(hashlib, "sha256", counting._real)
    (entry,) = rundir.resume().journal
    assert entry.digest == PayloadDigest(manifest.digest, CHUNK)
    assert entry.intact(entry.path.read_bytes()) and not entry.intact(entry.path.read_bytes() + b"!")
    rundir.close()


def test_an_unsealed_or_foreign_digest_is_refused_before_the_journal(tmp_path: Path) -> None:
    rundir, open_, data, manifest = _signed_upload(tmp_path)
    admission = Admission(UploadGate(), rundir, lambda _d: 100, _signatures(), contract=FEDHM.upload_contract)
    other = make_manifest(data + b"x", CHUNK, run=rundir.run_id, round=1, kind=UPDATE_KIND, transfer=manifest.transfer)
    forged = other.model_copy(update={"meta": manifest.meta})

    with pytest.raises(Exception, match="does not verify") as refused:
        admission.admit("pi-1", Received.of(Completed(forged, [data + b"x"])), open_, next_round=1)
    assert getattr(refused.value, "reason", None) == "bad_signature"
    assert rundir.resume().journal == []
    rundir.close()


def test_a_replayed_reversed_update_is_refused_at_the_close_after_a_resume(tmp_path: Path) -> None:
    """A coordinator killed after it receipted a reversed update: the resumed one measures the journaled
    update's direction again from what the round sends, so the peer check refuses it like a live one."""
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    (tmp_path / "fleet.yaml").write_text("fleet: lab\n")
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    devices = ["bad", "h1", "h2", "h3", "h4"]
    slots = [ClientSlot(device, 1.0, 100) for device in devices]
    sent = strategy.configure(1, slots)["h1"].tensors
    generator = torch.Generator().manual_seed(0)
    drift = {k: torch.randn(v.shape, generator=generator) for k, v in sent.items() if v.is_floating_point()}
    for i, device in enumerate(devices):
        sign = -1 if device == "bad" else 1
        noise = torch.Generator().manual_seed(i + 1)
        upload = {
            k: v + 0.01 * sign * (drift[k] + 0.5 * torch.randn(v.shape, generator=noise)) if k in drift else v
            for k, v in sent.items()
            if not is_norm_statistic(k)  # what a device sends: its BN statistics stay
        }
        meta = {"samples": 100, "train_seconds": 1.0, "loss": 0.5, "level": 1.0}
        assert rundir.accept_upload(1, device, f"t-{device}", upload, meta)
    rundir.close()

    def resumed(measure: bool) -> dict[str, str]:
        run = RunDir.open(tmp_path / "run")
        journal = run.resume().journal
        admission = Admission(UploadGate(), run, lambda device: 100, contract=strategy.upload_contract)
        open_ = OpenRound(1, {d: Participant(1.0) for d in devices}, strategy.open_round(1, slots), 1e12, 0.0)
        reopen = lambda: strategy.open_round(1, slots)  # noqa: E731
        assigned = (lambda: {d: a.tensors for d, a in strategy.configure(1, slots).items()}) if measure else None
        admission.replay(journal, open_, reopen, assigned)
        assert all(p.status == "accepted" for p in open_.participants.values())
        refused = admission.screen_round(open_, reopen)
        assert {d for d, p in open_.participants.items() if p.status != "accepted"} == set(refused)
        run.close()
        return refused

    assert resumed(measure=False) == {}  # before: replayed updates had no sketch, and were folded unjudged
    assert list(resumed(measure=True)) == ["bad"]


def test_an_upload_off_its_contract_is_refused_from_the_header_before_any_tensor_is_decoded(
    tmp_path: Path, monkeypatch
) -> None:
    rundir, open_, _, _ = _signed_upload(tmp_path)
    sent = FEDHM.configure(1, [ClientSlot("pi-1", 0.5, 100)])["pi-1"].tensors
    honest = {k: v for k, v in sent.items() if not is_norm_statistic(k)}
    decoded: list[int] = []
    real = admission_module.decode_tensors
    monkeypatch.setattr(admission_module, "decode_tensors", lambda data: decoded.append(len(data)) or real(data))
    admission = Admission(UploadGate(), rundir, lambda _d: 100, contract=FEDHM.upload_contract)
    wide = {**honest, "fc.weight": torch.zeros(10, 4096)}  # the dense classifier of another model

    def received(tensors: dict[str, torch.Tensor]) -> Received:
        data = encode_tensors(tensors)
        meta = {"samples": "100", "train_seconds": "2.0", "loss": "0.5"}
        manifest = make_manifest(data, run=rundir.run_id, round=1, kind=UPDATE_KIND, meta=meta)
        return Received.of(Completed(manifest, [data]))

    for tensors, reason, named in [
        (wide, "bad_shape", "'fc.weight': shape (10, 4096), expected"),
        ({**honest, "fc.weight": honest["fc.weight"].double()}, "bad_dtype", "'fc.weight': dtype torch.float64"),
        ({**honest, "fc.extra": torch.zeros(3)}, "unknown_tensor", "'fc.extra': not a tensor"),
        ({k: v for k, v in honest.items() if k != "fc.bias"}, "missing_tensor", "'fc.bias': missing"),
    ]:
        with pytest.raises(UpdateRejected, match=re.escape(named)) as refused:
            admission.admit("pi-1", received(tensors), open_, next_round=1)
        assert refused.value.reason == reason
    assert decoded == [] and rundir.resume().journal == []  # refused from the header: nothing decoded or journaled

    assert admission.admit("pi-1", received(honest), open_, next_round=1) == "accepted"
    assert len(decoded) == 1
    rundir.close()


def test_a_journaled_upload_off_its_contract_is_quarantined_on_replay_by_the_same_checks(tmp_path: Path) -> None:
    rundir, open_, _, _ = _signed_upload(tmp_path)
    sent = FEDHM.configure(1, [ClientSlot("pi-1", 0.5, 100)])["pi-1"].tensors
    upload = {k: v for k, v in sent.items() if not is_norm_statistic(k)}
    meta = {"samples": 100, "train_seconds": 1.0, "loss": 0.5, "level": 0.5}
    # What a release that checked less may have journaled: one tensor more than the level sends.
    assert rundir.accept_upload(1, "pi-1", "t-1", {**upload, "bn1.running_mean": torch.zeros(32)}, meta)
    journal = rundir.resume().journal
    admission = Admission(UploadGate(), rundir, lambda _d: 100, contract=FEDHM.upload_contract)

    admission.replay(journal, open_, lambda: FEDHM.open_round(1, [ClientSlot("pi-1", 0.5, 100)]))

    assert open_.participants["pi-1"].status == "assigned" and rundir.resume().journal == []
    (note,) = (rundir.path / QUARANTINE_DIR).glob("*.json")
    assert "unknown_tensor" in json.loads(note.read_text())["reason"]
    rundir.close()
