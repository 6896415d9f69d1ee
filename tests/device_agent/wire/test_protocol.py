"""The pure pieces of the round protocol: upload packing, upload meta and round seeds."""

from __future__ import annotations

import pytest
import torch

from device_agent.wire.messages import Receipt, RoundFailed, encode, parse_message
from device_agent.wire.protocol import (
    EXTRA_PREFIX,
    ReceivedEvaluation,
    UploadMeta,
    UploadMetaError,
    pack_upload,
    parse_upload_meta,
    round_seed,
    split_upload,
    upload_meta,
)


def test_pack_and_split_keep_upload_and_extras_apart() -> None:
    upload = {"conv.weight": torch.ones(2, 2)}
    extras = {"embedding": torch.zeros(3)}
    packed = pack_upload(upload, extras)
    assert set(packed) == {"conv.weight", EXTRA_PREFIX + "embedding"}
    back_upload, back_extras = split_upload(packed)
    assert back_upload.keys() == upload.keys() and back_extras.keys() == extras.keys()
    with pytest.raises(ValueError, match="may not start"):
        pack_upload({EXTRA_PREFIX + "x": torch.ones(1)}, {})


def test_upload_meta_is_checked_field_by_field() -> None:
    meta = upload_meta(120, 1.5, 0.25)
    assert parse_upload_meta(meta) == UploadMeta(120, 1.5, 0.25, None)
    with pytest.raises(UploadMetaError, match="samples"):
        parse_upload_meta({"loss": "0.1", "train_seconds": "1"})
    with pytest.raises(UploadMetaError, match=r"samples=0 is outside \[1, 1e\+09\]"):
        parse_upload_meta({**meta, "samples": "0"})
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(UploadMetaError, match=r"loss=.* is not a finite number"):
            parse_upload_meta({**meta, "loss": bad})


def test_upload_meta_carries_the_local_accuracy_of_a_personalized_model() -> None:
    meta = upload_meta(90, 0.5, 0.1, local_accuracy=0.875)
    assert parse_upload_meta(meta).local_accuracy == 0.875
    with pytest.raises(UploadMetaError, match=r"local_accuracy=1\.5"):
        parse_upload_meta({**meta, "local_accuracy": "1.5"})


def test_upload_meta_carries_the_federated_evaluation_of_the_received_model() -> None:
    meta = upload_meta(90, 0.5, 0.1, received=ReceivedEvaluation(accuracy=0.75, loss=0.8, samples=40))
    assert parse_upload_meta(meta).received == ReceivedEvaluation(0.75, 0.8, 40)
    assert parse_upload_meta(upload_meta(90, 0.5, 0.1)).received is None


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"global_accuracy": "1.5"}, r"global_accuracy=1\.5 is outside \[0, 1\]"),
        ({"global_accuracy": "nan"}, r"global_accuracy=nan is not a finite number"),
        ({"global_loss": "inf"}, r"global_loss=inf is not a finite number"),
        ({"global_loss": "-0.5"}, r"global_loss=-0\.5 is outside \[0, 1e\+06\]"),
        ({"global_loss": "1.7e308"}, r"global_loss=1\.7e\+308 is outside \[0, 1e\+06\]"),
        ({"eval_samples": "0"}, r"eval_samples=0 is outside \[1, 1e\+09\]"),
        ({"eval_samples": "many"}, r"invalid literal for int"),
    ],
)
def test_federated_evaluation_figures_out_of_range_are_refused(change, problem) -> None:
    meta = upload_meta(90, 0.5, 0.1, received=ReceivedEvaluation(accuracy=0.75, loss=0.8, samples=40))
    with pytest.raises(UploadMetaError, match=problem):
        parse_upload_meta({**meta, **change})


def test_federated_evaluation_figures_come_all_together() -> None:
    meta = upload_meta(90, 0.5, 0.1, received=ReceivedEvaluation(accuracy=0.75, loss=0.8, samples=40))
    del meta["eval_samples"]
    with pytest.raises(UploadMetaError, match="has global_accuracy, global_loss but lacks eval_samples"):
        parse_upload_meta(meta)


def test_upload_meta_of_an_emulated_device_splits_host_from_device_seconds() -> None:
    meta = upload_meta(90, 2.0, 0.1, host_seconds=0.5)
    assert parse_upload_meta(meta).host_seconds == 0.5
    assert parse_upload_meta(upload_meta(90, 2.0, 0.1)).host_seconds is None  # a real device, or an older agent
    with pytest.raises(UploadMetaError, match=r"host_seconds=3\.0 is not in \[0, train_seconds=2\.0\]"):
        parse_upload_meta({**meta, "host_seconds": "3.0"})


def test_round_seeds_differ_per_device_and_round_and_repeat_per_run() -> None:
    seeds = {round_seed(7, r, d) for r in range(1, 4) for d in range(5)}
    assert len(seeds) == 15
    assert round_seed(7, 2, 3) == round_seed(7, 2, 3) != round_seed(8, 2, 3)


def test_receipt_and_round_failed_travel_as_control_messages() -> None:
    receipt = Receipt(run="r1", round=3, transfer="a" * 32, status="accepted")
    assert parse_message(encode(receipt)) == receipt
    failure = RoundFailed(run="r1", round=3, reason="out_of_memory", detail="cap 512 MiB")
    assert parse_message(encode(failure)) == failure
