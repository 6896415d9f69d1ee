"""A journaled upload always closes its round: bounded meta by construction, and quarantine for older journals.

The crash this guards against: ``global_loss = 1.7e308`` with ``eval_samples = 2**53`` passed the
meta checks of earlier releases, was journaled, and overflowed the round's federated loss to inf at
the close; every resume replayed it and stopped again.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.admission import journaled_meta
from coordinator.rounds.closing import round_metrics
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.rounds.upload_gate import UploadGate
from coordinator.run.metrics import DeviceRoundMetrics, received_metrics
from coordinator.run.rundir import QUARANTINE_DIR, RunDir
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.base import is_norm_statistic
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.wire.protocol import UploadMetaError
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)
EXPECTED_SAMPLES = 1_000

extreme = st.sampled_from(["1.7e308", "1e300", "-1e300", str(2**53), str(10**9), "1e6", "0", "-0", "1", "nan"])
number_text = st.one_of(extreme, st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers().map(str))
meta_strategy = st.fixed_dictionaries(
    {"samples": number_text, "train_seconds": number_text, "loss": number_text},
    optional={
        key: number_text for key in ("local_accuracy", "host_seconds", "global_accuracy", "global_loss", "eval_samples")
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(meta_strategy, min_size=1, max_size=6))
def test_any_meta_the_gate_accepts_closes_the_round(metas) -> None:
    gate = UploadGate()
    accepted = []
    for meta in metas:
        try:
            accepted.append(gate.meta(meta, EXPECTED_SAMPLES))
        except (UploadMetaError, ValueError):
            continue
    devices = {
        f"d{i}": DeviceRoundMetrics(
            device_class="pi",
            ratio=1.0,
            bytes_up=0,
            bytes_down=0,
            payload_bytes=0,
            train_seconds=meta.train_seconds,
            host_seconds=meta.host_seconds,
            status="accepted",
            local_accuracy=meta.local_accuracy,
            **received_metrics(meta.received),
        )
        for i, meta in enumerate(accepted)
    }
    metrics = round_metrics(1, devices, (m.received for m in accepted), None, 1.0, {})
    assert metrics.participants == len(accepted)
    if metrics.federated_loss is not None:
        assert math.isfinite(metrics.federated_loss) and 0 <= metrics.federated_accuracy <= 1


def poisoned_journal_meta(payload_bytes: int) -> dict:
    """What a release without the upload schema journaled for the federated-evaluation overflow."""
    received = {"accuracy": 0.5, "loss": 1.7e308, "samples": 2**53}
    return {
        "samples": 100,
        "train_seconds": 1.0,
        "loss": 0.5,
        "level": 1.0,
        "payload_bytes": payload_bytes,
        "local_accuracy": None,
        "host_seconds": None,
        "received": received,
    }


def test_a_journaled_meta_is_read_again_through_todays_schema() -> None:
    assert journaled_meta({"samples": 100, "train_seconds": 1.0, "loss": 0.5}).samples == 100
    try:
        journaled_meta(poisoned_journal_meta(10))
    except UploadMetaError as exc:
        assert "global_loss=1.7e+308 is outside [0, 1e+06]" in str(exc)
    else:
        raise AssertionError("the overflowing evaluation passed")


@pytest.mark.slow
def test_a_poisoned_journal_entry_is_quarantined_on_resume_and_the_run_goes_on(tmp_path: Path, caplog) -> None:
    clients = digit_clients(["pi-0", "pi-1"])
    data = load_dataset("digits", 8, 1)
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, 1, TrainConfig(batch_size=32))
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "run"
    created = RunDir.create(run_dir, fleet_file, strategy.state_dict(), seed=0)
    sent = strategy.configure(1, [ClientSlot("pi-0", 1.0, 100)])["pi-0"].tensors
    upload = {k: v for k, v in sent.items() if not is_norm_statistic(k)}
    created.accept_upload(1, "pi-0", "a" * 32, upload, poisoned_journal_meta(1000))
    created.close()

    rundir = RunDir.open(run_dir, fleet_file)
    engine = RoundEngine(
        parse_fleet(raw, source="test"),
        {},
        build_strategy("fedavg", CNN, {}, seed=0),
        rundir,
        data,
        MemoryLink([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
        EngineSettings(min_devices=2, wait_timeout_s=60, calibration_samples=len(data.train_x)),
        planner=fixed_levels({c.client_id: c.level for c in clients}),
    )
    with caplog.at_level(logging.ERROR, logger="fedfleet.engine"):
        assert engine.run()
    (closed,) = rundir.metrics()
    rundir.close()
    assert closed.participants == 2 and math.isfinite(closed.federated_loss)  # pi-0 trained the round again
    (note,) = (run_dir / QUARANTINE_DIR).glob("*.json")
    kept = json.loads(note.read_text())
    assert kept["device"] == "pi-0" and "global_loss=1.7e+308 is outside" in kept["reason"]
    assert note.with_suffix(".safetensors").is_file()
    assert any("quarantined in" in r.getMessage() and "pi-0" in r.getMessage() for r in caplog.records)


def test_every_core_lends_torch_all_cores_for_the_evaluation_then_gives_them_back(monkeypatch) -> None:
    import torch

    from coordinator.rounds import closing

    seen = []
    monkeypatch.setattr(closing.os, "sched_getaffinity", lambda _pid: {0, 1, 2}, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as coordinator emulate leaves it, so the cores train the devices
    try:
        with closing.every_core():
            seen.append(torch.get_num_threads())
        assert seen == [3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
