"""The outbox keeps a finished update across restarts until the coordinator acks it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from device_agent.agent.outbox import Outbox, OutboxCorrupt


def update(value: float) -> dict[str, torch.Tensor]:
    return {"layer1.reduce": torch.full((8, 3, 1, 3), value), "fc.weight": torch.full((10, 8), value)}


def test_an_update_survives_a_restart_until_it_is_acked(tmp_path: Path) -> None:
    item = Outbox(tmp_path).put("run1", 4, "tx-a", update(1.5), {"samples": 120, "ratio": 0.25})
    assert item.sha256 == hashlib.sha256(item.payload_path.read_bytes()).hexdigest()

    restarted = Outbox(tmp_path)  # a new agent process on the same directory
    (pending,) = restarted.pending()
    assert (pending.run, pending.round, pending.transfer_id, pending.meta) == ("run1", 4, "tx-a", item.meta)
    assert pending.size == len(restarted.payload(pending))
    assert torch.equal(restarted.tensors(pending)["fc.weight"], update(1.5)["fc.weight"])

    assert restarted.ack("run1", 4, "tx-a")
    assert not restarted.ack("run1", 4, "tx-a")  # a duplicated ack is harmless
    assert restarted.pending() == []
    assert list(tmp_path.iterdir()) == []


def test_pending_lists_oldest_round_first(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    outbox.put("run1", 7, "tx-7", update(7))
    outbox.put("run1", 5, "tx-5", update(5))
    assert [item.round for item in outbox.pending()] == [5, 7]
    outbox.discard(outbox.pending()[0])
    assert [item.round for item in outbox.pending()] == [7]


def test_a_corrupted_payload_is_refused(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    item = outbox.put("run1", 1, "tx", update(2.0))
    data = bytearray(item.payload_path.read_bytes())
    data[-1] ^= 0xFF
    item.payload_path.write_bytes(bytes(data))
    with pytest.raises(OutboxCorrupt, match=r"sha256 .* does not match the recorded .* must not be sent"):
        outbox.payload(item)
    item.payload_path.unlink()
    with pytest.raises(OutboxCorrupt, match="is missing"):
        outbox.tensors(item)


def test_a_payload_without_its_sidecar_is_crash_debris(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    item = outbox.put("run1", 1, "tx", update(2.0))
    (tmp_path / "run1.r000001.tx.json").unlink()  # the crash came between the two writes
    assert Outbox(tmp_path).pending() == []  # the restarted agent
    assert not item.payload_path.exists()


def test_an_unreadable_sidecar_is_named(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    outbox.put("run1", 1, "tx", update(2.0))
    (tmp_path / "run1.r000001.tx.json").write_text("{not json")
    with pytest.raises(OutboxCorrupt, match=r"run1\.r000001\.tx\.json: not an outbox entry"):
        outbox.pending()


def test_names_that_could_escape_the_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"transfer id '\.\./x' must be"):
        Outbox(tmp_path).put("run1", 1, "../x", update(0))
