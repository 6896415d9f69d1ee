"""The round engine under secure_aggregation never reads an update sent in the clear."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.screening import OFF
from coordinator.emulation.simulation import simulation_fleet
from coordinator.rounds.settings import EngineSettings
from coordinator.strategies import ModelSpec, build_strategy
from device_agent.training.optimizer import TrainConfig
from device_agent.wire.codec import encode_tensors
from device_agent.wire.messages import Error, Message
from device_agent.wire.payload import Received
from device_agent.wire.protocol import UPDATE_KIND
from tests.digit_clients import digit_clients, digit_engine

SECURE = {"threshold": 2, "neighbours": 2, "clip": 0.5, "bits": 16}


class RecordingLink:
    """The engine's Link, recording what it sends (nothing runs: the test hands the engine a payload itself)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def send_control(self, device: str, message: Message) -> None:
        self.sent.append((device, message))


def test_a_plain_update_under_secure_aggregation_is_refused_unread(tmp_path: Path) -> None:
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    clients = digit_clients(["d0", "d1", "d2"])
    raw = simulation_fleet(strategy, clients, 1, TrainConfig(), limits=OFF, secure_aggregation=SECURE)
    link = RecordingLink()
    engine = digit_engine(
        tmp_path, raw, strategy, link, {c.client_id: 1.0 for c in clients}, EngineSettings(min_devices=3)
    )
    data = encode_tensors({k: torch.zeros_like(v) for k, v in strategy.global_state().items()})
    plain = Received(
        run=engine.rundir.run_id, round=1, kind=UPDATE_KIND, transfer="0" * 32, meta={}, digest=None, data=data
    )

    engine._on_payload(clients[0].client_id, plain)

    [(device, message)] = link.sent
    assert device == clients[0].client_id and isinstance(message, Error) and message.code == "rejected"
    assert "plain update under secure_aggregation" in message.detail
    assert engine.refused.counts[(device, "wrong_kind")] == 1
    assert not (tmp_path / "run" / "journal").exists() or not any((tmp_path / "run" / "journal").rglob("*.safetensors"))
