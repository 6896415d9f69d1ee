"""Property: any manifest meta parses into UploadMeta or raises UploadMetaError.

Parsed values must also be safe downstream: sample counts become float64 aggregation weights.
"""

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from device_agent.wire.protocol import MAX_SAMPLES, UploadMetaError, parse_upload_meta

FUZZ = settings(max_examples=200)
numbers = st.one_of(
    st.text(max_size=12),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e999", "1_000", " 7 ", "9" * 5000, "0x10"]),
)
keys = st.sampled_from(["samples", "train_seconds", "loss", "local_accuracy", "host_seconds", "other"])


@FUZZ
@given(st.dictionaries(keys, numbers))
@example({"samples": "9" * 400, "train_seconds": "1", "loss": "0"})  # was accepted: OverflowError at round close
@example({"samples": "9" * 5000, "train_seconds": "1", "loss": "0"})
@example({"samples": "1", "train_seconds": "nan", "loss": "0"})
@example({"samples": "1", "train_seconds": "1", "loss": "0", "host_seconds": "nan"})
def test_upload_meta_parses_or_raises_upload_meta_error(meta):
    try:
        parsed = parse_upload_meta(meta)
    except UploadMetaError as exc:
        assert str(exc)
    else:
        assert 1 <= parsed.samples <= MAX_SAMPLES and math.isfinite(parsed.train_seconds) and math.isfinite(parsed.loss)
        assert parsed.local_accuracy is None or 0 <= parsed.local_accuracy <= 1


def test_a_sample_count_past_its_range_is_refused_before_the_journal():
    meta = {"train_seconds": "1", "loss": "0"}
    assert parse_upload_meta({**meta, "samples": str(MAX_SAMPLES)}).samples == MAX_SAMPLES
    with pytest.raises(UploadMetaError, match=r"samples=1000000000000000000000 is outside \[1, 1e\+09\]"):
        parse_upload_meta({**meta, "samples": str(10**21)})
