"""The upload gate: a broken or hostile upload is refused and logged, the round goes on, nothing of it counts.

The fleet is in-process (the engine behind an :class:`InProcessLink`), one device of which
tampers with what it sends after training, as a compromised or buggy device would.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from coordinator.local_link import InProcessLink, LocalDevice
from coordinator.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.transfer import Completed, make_manifest

CNN = ModelSpec("cnn", 10, 1, 8)


class TamperingLink(InProcessLink):
    """Device ``bad`` rewrites its update (tensors or meta) after it trained."""

    def __init__(self, devices: list[LocalDevice], tamper) -> None:
        super().__init__(devices)
        self.tamper = tamper

    def start(self, on_message, on_payload) -> None:
        def intercept(device: str, completed: Completed) -> None:
            if device == "bad":
                tensors, meta = self.tamper(decode_tensors(completed.data), dict(completed.manifest.meta))
                data = encode_tensors(tensors)
                manifest = completed.manifest
                completed = Completed(
                    make_manifest(data, run=manifest.run, round=manifest.round, kind=manifest.kind, meta=meta), [data]
                )
            on_payload(device, completed)

        super().start(on_message, intercept)


def nan_weights(tensors, meta):
    tensors["fc.weight"] = torch.full_like(tensors["fc.weight"], math.nan)
    return tensors, meta


def huge_weights(tensors, meta):
    tensors["fc.weight"] = torch.full_like(tensors["fc.weight"], 3e38)
    return tensors, meta


def nan_loss(tensors, meta):
    return tensors, {**meta, "loss": "nan"}


def bad_global_accuracy(tensors, meta):
    return tensors, {**meta, "global_accuracy": "1.5"}


def missing_layer(tensors, meta):
    del tensors["conv1.weight"]
    return tensors, meta


@pytest.fixture(scope="module")
def clients() -> list[SimClient]:
    data = load_dataset("digits", 8, 1)
    spec = PartitionSpec("iid", 2, seed=0)
    return [
        SimClient(
            name,
            1.0,
            client_shard(data.train_x, data.train_y, spec, i),
            client_shard(data.test_x, data.test_y, spec, i),
        )
        for i, name in enumerate(("bad", "good"))
    ]


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (nan_weights, "'fc.weight': contains NaN or infinite values"),
        (huge_weights, "'fc.weight': a value of magnitude 3e+38 exceeds the bound"),
        (nan_loss, "loss=nan is not a finite number"),
        (bad_global_accuracy, "global_accuracy=1.5 is not in [0, 1]"),
        (missing_layer, "conv1.weight"),
    ],
)
def test_a_bad_upload_is_refused_logged_and_never_folded(clients, tamper, reason, monkeypatch, caplog) -> None:
    data = load_dataset("digits", 8, 1)
    monkeypatch.setattr("coordinator.simulation.InProcessLink", lambda devices: TamperingLink(list(devices), tamper))
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    with caplog.at_level(logging.WARNING, logger="fedfleet.engine"):
        result = simulate(strategy, clients, 2, TrainConfig(batch_size=32), (data.test_x, data.test_y), data.train_x)
    assert [r.round for r in result.rounds] == [1, 2]  # the rounds went on
    for record in result.rounds:
        assert set(record.upload_bytes) == {"good"}  # only the good device counted
    assert all(torch.isfinite(v).all() for v in strategy.global_state().values() if v.is_floating_point())
    assert result.final.accuracy > 0.5
    refusals = [r.getMessage() for r in caplog.records if "rejected bad's update" in r.getMessage()]
    assert len(refusals) == 2 and all(reason in message for message in refusals)
