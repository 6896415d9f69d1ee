"""Upload signatures: what the agent signs and how the coordinator tells a forgery from a replay."""

import hashlib
import hmac

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from device_agent.agent.signing import SignatureError, UploadIdentity, parse_key, signed_meta, verify

KEY = bytes(range(32))
IDENTITY = UploadIdentity("lab", "run-1", 3, "pi-1", "a" * 32, "b" * 64)
META = {"samples": "10", "train_seconds": "1.0", "loss": "0.5"}


def _refused(key: bytes, meta: dict, identity: UploadIdentity = IDENTITY) -> str:
    with pytest.raises(SignatureError) as caught:
        verify(key, meta, identity)
    return caught.value.reason


def test_a_signed_upload_verifies_and_keeps_its_meta():
    meta = signed_meta(META, KEY, IDENTITY)
    verify(KEY, meta, IDENTITY)
    assert {k: meta[k] for k in META} == META
    assert (meta["signed_round"], meta["signed_transfer"]) == ("3", "a" * 32)


def test_another_key_or_altered_fields_are_a_bad_signature():
    meta = signed_meta(META, KEY, IDENTITY)
    assert _refused(bytes(32), meta) == "bad_signature"
    assert _refused(KEY, {**meta, "signed_round": "4"}, IDENTITY) == "bad_signature"
    for changed in ("fleet", "run", "device", "digest"):
        other = UploadIdentity(**{**IDENTITY.__dict__, changed: "c" * 64 if changed == "digest" else "x"})
        assert _refused(KEY, meta, other) == "bad_signature", changed
    assert _refused(KEY, {**meta, "signed_round": "three"}) == "bad_signature"


@pytest.mark.parametrize("change", [{"samples": "1000"}, {"loss": "0.01"}, {"global_loss": "1"}, {"samples": "10 "}])
def test_the_signature_covers_the_meta_so_a_login_cannot_reweight_an_update(change):
    meta = signed_meta(META, KEY, IDENTITY)
    assert _refused(KEY, {**meta, **change}) == "bad_signature"
    assert _refused(KEY, {k: v for k, v in meta.items() if k != "loss"}) == "bad_signature"


def test_an_upload_signed_as_earlier_releases_did_is_refused_as_outdated():
    """Releases before the meta was covered signed the identity alone: refused by name, not as a forgery."""
    meta = {**META, "signed_round": "3", "signed_transfer": "a" * 32}
    meta["signature"] = hmac.new(KEY, IDENTITY.identity_only_bytes(), hashlib.sha256).hexdigest()
    with pytest.raises(SignatureError, match="install the agent kit of the coordinator's release") as caught:
        verify(KEY, meta, IDENTITY)
    assert caught.value.reason == "outdated_signature"


def test_a_genuine_signature_for_another_round_or_transfer_is_a_replay():
    meta = signed_meta(META, KEY, IDENTITY)
    for round_, transfer in ((4, IDENTITY.transfer), (3, "d" * 32)):
        resent = UploadIdentity("lab", "run-1", round_, "pi-1", transfer, "b" * 64)
        with pytest.raises(SignatureError, match="signed for round 3") as caught:
            verify(KEY, meta, resent)
        assert caught.value.reason == "replayed"


def test_an_unsigned_upload_is_refused_as_unsigned():
    assert _refused(KEY, META) == "unsigned"


@pytest.mark.parametrize(("text", "problem"), [("zz", "not hexadecimal"), ("00" * 8, "8 bytes, at least 16")])
def test_a_bad_key_file_is_named(text, problem):
    with pytest.raises(ValueError, match=f"kits/pi-1/signing.key: {problem}"):
        parse_key(text, "kits/pi-1/signing.key")
    assert parse_key(KEY.hex() + "\n") == KEY


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from(["signature", "signed_round", "signed_transfer"]), st.text(max_size=70)))
@example({"signature": "\ud800" * 64, "signed_round": "3", "signed_transfer": "a" * 32})  # was UnicodeEncodeError
@example({"signature": "é" * 64, "signed_round": "3", "signed_transfer": "a" * 32})
@example({"signature": "0" * 64, "signed_round": "9" * 5000, "signed_transfer": "\ud800"})
def test_any_meta_verifies_or_raises_signature_error(meta):
    try:
        verify(KEY, {**META, **meta}, IDENTITY)
    except SignatureError as exc:
        assert exc.reason in {"unsigned", "bad_signature", "outdated_signature", "replayed"}
