"""Signed uploads, coordinator side: keys provisioned into the kits, and the check the upload gate runs."""

from __future__ import annotations

import stat
import tarfile
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import FleetError, load_fleet
from coordinator.provision import DeviceLayout, provision
from coordinator.provision.layout import SIGNING_KEY
from coordinator.rounds.engine import refusal_reason
from coordinator.rounds.signing import SignatureRefused, upload_signatures
from device_agent.agent.config import parse_config
from device_agent.agent.signing import UploadIdentity, signed_meta
from device_agent.wire.payload import Received
from device_agent.wire.transfer import Completed, make_manifest

PAYLOAD = b"the update's safetensors bytes"


def _fleet_file(tmp_path: Path, security: str = "security: {sign_uploads: true}\n") -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "fleet: lab\nbroker: {mode: external, url: 'mqtt://127.0.0.1:1883'}\n"
        + security
        + "devices:\n  - {id: pi-1, profile: raspberry-pi-5}\n  - {id: pi-2, profile: raspberry-pi-5}\n"
    )
    return path


@pytest.fixture
def provisioned(tmp_path: Path):
    fleet, _ = load_fleet(_fleet_file(tmp_path))
    kits = provision(fleet, tmp_path / "kits", layout=DeviceLayout(tmp_path / "opt", tmp_path / "state")).kits
    return fleet, kits


def _upload(key: bytes, round_: int = 1, signed_round: int | None = None, transfer: str | None = None):
    """A sealed update manifest of run-1 from pi-1, signed with ``key`` (for ``signed_round`` if given)."""
    manifest = make_manifest(PAYLOAD, run="run-1", round=round_, kind="update", transfer=transfer)
    identity = UploadIdentity("lab", "run-1", signed_round or round_, "pi-1", manifest.transfer, manifest.digest)
    return manifest.model_copy(update={"meta": signed_meta({"samples": "5"}, key, identity)})


def _resealed(manifest, payload: bytes):
    """``manifest``'s signed meta over other bytes: a transfer sealed anew for a tampered payload."""
    other = make_manifest(payload, run=manifest.run, round=manifest.round, kind="update", transfer=manifest.transfer)
    return other.model_copy(update={"meta": manifest.meta})


def _arrived(manifest) -> Received:
    """What the link hands the engine once the transfer ``manifest`` announced has arrived (its bytes unread)."""
    return Received.of(Completed(manifest, []))


def test_provisioning_makes_one_secret_key_per_device_and_keeps_it(provisioned, tmp_path: Path) -> None:
    fleet, kits = provisioned
    key_file = kits.participant("pi-1") / SIGNING_KEY
    key = key_file.read_text()
    assert len(bytes.fromhex(key)) == 32 and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key != (kits.participant("pi-2") / SIGNING_KEY).read_text()
    config = parse_config(yaml.safe_load((kits.participant("pi-1") / "agent.yaml").read_text()))
    assert config.signing_key == f"file:{tmp_path / 'opt' / 'etc' / SIGNING_KEY}"
    with tarfile.open(kits.bundle("pi-1")) as bundle:
        assert f"pi-1/{SIGNING_KEY}" in bundle.getnames()
    assert SIGNING_KEY in (kits.participant("pi-1") / "install.sh").read_text()

    layout = DeviceLayout(tmp_path / "opt", tmp_path / "state")
    provision(fleet, kits.root, layout=layout)
    assert key_file.read_text() == key
    provision(fleet, kits.root, rotate=["pi-1"], layout=layout)
    assert key_file.read_text() != key


def test_the_gate_accepts_its_devices_signature_and_names_every_refusal(provisioned) -> None:
    fleet, kits = provisioned
    signatures = upload_signatures(fleet, kits)
    assert signatures is not None
    key = bytes.fromhex((kits.participant("pi-1") / SIGNING_KEY).read_text())
    signatures.check("pi-1", _arrived(_upload(key)))

    cases = {
        "bad_signature": ("pi-1", _upload(bytes(32))),  # signed with another key
        "replayed": ("pi-1", _upload(key, round_=2, signed_round=1)),  # round 1's update as round 2's
        "unsigned": ("pi-1", make_manifest(PAYLOAD, run="run-1", round=1, kind="update")),
    }
    cases["tampered"] = ("pi-1", _resealed(_upload(key), PAYLOAD + b"!"))  # other bytes under a genuine signature
    cases["impersonated"] = ("pi-2", _upload(key))  # pi-1's key cannot sign for pi-2
    cases["unsealed"] = ("pi-1", _upload(key).model_copy(update={"digest": None, "chunks": None}))
    expected = {"tampered": "bad_signature", "impersonated": "bad_signature", "unsealed": "bad_signature"}
    for name, (device, manifest) in cases.items():
        with pytest.raises(SignatureRefused) as caught:
            signatures.check(device, _arrived(manifest))
        assert refusal_reason(caught.value) == expected.get(name, name), name


def test_signing_is_off_unless_fleet_yaml_asks_and_needs_provisioned_keys(tmp_path: Path) -> None:
    fleet, _ = load_fleet(_fleet_file(tmp_path, security=""))
    kits = provision(fleet, tmp_path / "kits", layout=DeviceLayout(tmp_path / "opt", tmp_path / "state")).kits
    assert upload_signatures(fleet, kits) is None
    assert not (kits.participant("pi-1") / SIGNING_KEY).exists()
    assert "signing_key" not in (kits.participant("pi-1") / "agent.yaml").read_text()

    signed, _ = load_fleet(_fleet_file(tmp_path))
    with pytest.raises(ValueError, match=r"pi-1/signing\.key is missing; run coordinator provision"):
        upload_signatures(signed, kits)


def test_a_misspelt_security_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match=r"security\.sign_upload"):
        load_fleet(_fleet_file(tmp_path, security="security: {sign_upload: true}\n"))
