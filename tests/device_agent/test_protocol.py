"""The pure pieces of the round protocol: assignment options, upload packing and upload meta."""

from __future__ import annotations

import hashlib

import pytest
import torch

from device_agent.protocol import (
    EXTRA_PREFIX,
    UploadMeta,
    UploadMetaError,
    assignment_options,
    pack_upload,
    parse_options,
    parse_upload_meta,
    split_upload,
    upload_meta,
)
from device_agent.training import TrainConfig
from device_agent.wire.messages import Receipt, RoundFailed, encode, parse_message


def test_assignment_options_round_trip_the_meta_and_training_settings() -> None:
    meta = {"strategy": "fedhm", "arch": "cnn", "level": 0.25}
    train = TrainConfig(epochs=3, batch_size=16, lr=0.1, seed=7)
    got_meta, got_train = parse_options(assignment_options(meta, train))
    assert got_meta == meta
    assert got_train == train


def test_options_with_an_unknown_training_key_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        parse_options({"meta": {}, "train": {"optimizer": "adam"}})
    with pytest.raises(ValueError, match="meta"):
        parse_options({"train": {}})


def test_pack_and_split_keep_upload_and_extras_apart() -> None:
    upload = {"conv.weight": torch.ones(2, 2)}
    extras = {"embedding": torch.zeros(3)}
    packed = pack_upload(upload, extras)
    assert set(packed) == {"conv.weight", EXTRA_PREFIX + "embedding"}
    back_upload, back_extras = split_upload(packed)
    assert back_upload.keys() == upload.keys() and back_extras.keys() == extras.keys()
    with pytest.raises(ValueError, match="may not start"):
        pack_upload({EXTRA_PREFIX + "x": torch.ones(1)}, {})


def test_upload_meta_checks_the_sha256_against_the_payload() -> None:
    payload = b"some safetensors bytes"
    meta = {**upload_meta(120, 1.5, 0.25), "sha256": hashlib.sha256(payload).hexdigest()}
    assert parse_upload_meta(meta, payload) == UploadMeta(120, 1.5, 0.25, None)
    with pytest.raises(UploadMetaError, match="sha256"):
        parse_upload_meta(meta, payload + b"!")
    with pytest.raises(UploadMetaError, match="samples"):
        parse_upload_meta({"sha256": meta["sha256"]}, payload)
    with pytest.raises(UploadMetaError, match="out of range"):
        parse_upload_meta({**meta, "samples": "0"}, payload)


def test_upload_meta_carries_the_local_accuracy_of_a_personalized_model() -> None:
    payload = b"u vectors"
    meta = {**upload_meta(90, 0.5, 0.1, local_accuracy=0.875), "sha256": hashlib.sha256(payload).hexdigest()}
    assert parse_upload_meta(meta, payload).local_accuracy == 0.875
    with pytest.raises(UploadMetaError, match=r"local_accuracy=1\.5"):
        parse_upload_meta({**meta, "local_accuracy": "1.5"}, payload)


def test_receipt_and_round_failed_travel_as_control_messages() -> None:
    receipt = Receipt(run="r1", round=3, transfer="a" * 32, status="accepted")
    assert parse_message(encode(receipt)) == receipt
    failure = RoundFailed(run="r1", round=3, reason="out_of_memory", detail="cap 512 MiB")
    assert parse_message(encode(failure)) == failure
