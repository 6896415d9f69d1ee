"""Property: whatever a crash or a bad disk left in a sidecar, pending() lists entries or raises OutboxCorrupt."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from device_agent.agent.outbox import Outbox, OutboxCorrupt

FUZZ = settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
sidecars = st.one_of(
    st.binary(max_size=200),
    st.fixed_dictionaries(
        {},
        optional={k: values for k in ("run", "round", "transfer_id", "sha256", "size", "meta")},
    ).map(lambda d: json.dumps(d).encode()),
)


def _write(tmp_path: Path, name: str, data: bytes) -> Outbox:
    for old in tmp_path.iterdir():
        old.unlink()
    outbox = Outbox(tmp_path)
    (tmp_path / f"{name}.json").write_bytes(data)
    return outbox


@FUZZ
@given(sidecars)
@example(b"[" * 100_000)
@example(b'{"run": 5, "round": 1, "transfer_id": "t", "sha256": "x", "size": 1}')
@example(b'{"run": "r", "round": Infinity, "transfer_id": "t", "sha256": "x", "size": 1}')
@example(b'{"run": "../x", "round": 1, "transfer_id": "t", "sha256": "x", "size": 1}')
def test_pending_lists_readable_entries_or_raises_outbox_corrupt(tmp_path, data):
    outbox = _write(tmp_path, "r.r000001.t", data)
    try:
        items = outbox.pending()
    except OutboxCorrupt as exc:
        assert "not an outbox entry" in str(exc)
    else:
        assert all(isinstance(item.run, str) and isinstance(item.transfer_id, str) for item in items)


def test_a_nesting_bomb_in_a_sidecar_names_the_file(tmp_path):
    outbox = _write(tmp_path, "r.r000001.t", b"[" * 100_000)
    with pytest.raises(OutboxCorrupt, match=r"r\.r000001\.t\.json: not an outbox entry"):
        outbox.pending()
