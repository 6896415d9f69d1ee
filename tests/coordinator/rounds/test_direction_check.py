"""The upload gate's direction checks: an update pointing away from the fleet's is refused, in the gate and
in a simulated round (a sign-flipped update is within the norm bound, so only its direction gives it away).
Two references: last round's direction (opt-in) and, by default, the sum of the round's other updates."""

from __future__ import annotations

import logging

import pytest
import torch

from coordinator.config.limits import GateSettings
from coordinator.emulation.simulation import simulate
from coordinator.rounds.upload_gate import UploadGate, UploadRefused, squared_norms
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.payload import Received
from tests.digit_clients import digit_clients

SENT = {"w": torch.ones(100), "b": torch.zeros(10)}
DRIFT = {"w": torch.linspace(-1, 1, 100), "b": torch.ones(10)}
"""Where the fleet's honest updates go this round and the next (plus noise of their own)."""


def honest(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * (DRIFT[k] + 0.5 * torch.randn(v.shape, generator=generator)) for k, v in SENT.items()}


def flipped(seed: int) -> dict[str, torch.Tensor]:
    return {k: 2 * SENT[k] - v for k, v in honest(seed).items()}


def second_round_gate(settings: GateSettings) -> UploadGate:
    """A gate past one round of four honest updates, with round 2 open and sent to ``bad`` and ``good``."""
    gate = UploadGate(settings)
    for i in range(4):
        gate.sent(f"h{i}", squared_norms(SENT), SENT)
        screened = gate.norm(f"h{i}", 1.0, honest(i))
        assert screened.cosine is None  # round 1: no reference yet, nothing refused for its direction
        gate.accepted(1.0, screened)
    gate.open_round()
    for device in ("bad", "good"):
        gate.sent(device, squared_norms(SENT), SENT)
    return gate


def test_a_sign_flipped_update_is_refused_an_honest_one_passes_with_its_cosine() -> None:
    gate = second_round_gate(GateSettings(direction_min_cosine=0.0))
    with pytest.raises(UploadRefused, match=r"cosine -0\.[0-9]+ with the fleet's direction") as refused:
        gate.norm("bad", 1.0, flipped(9))
    assert refused.value.reason == "wrong_direction"
    screened = gate.norm("good", 1.0, honest(8))
    assert screened.cosine is not None and screened.cosine > 0.5
    assert screened.steps == {}  # within the norm bound too: folded as sent


def test_the_check_is_off_by_default_and_its_threshold_configurable() -> None:
    assert GateSettings().direction_min_cosine is None  # opt-in: honest non-IID rounds can point apart
    assert GateSettings().peer_min_cosine == -0.2  # the same-round check is the default
    assert second_round_gate(GateSettings()).norm("bad", 1.0, flipped(9)).cosine is None
    with pytest.raises(UploadRefused, match=r"at least 0\.99"):
        second_round_gate(GateSettings(direction_min_cosine=0.99)).norm("good", 1.0, honest(8))


class SignFlipLink(MemoryLink):
    """Device ``bad`` trains honestly, then uploads what it was sent minus its update (float tensors)."""

    def __init__(self, devices: list[LocalDevice]) -> None:
        super().__init__(devices)
        self.sent: dict[str, dict[str, torch.Tensor]] = {}

    def send_payload(self, device, payload, manifest):  # type: ignore[no-untyped-def]
        self.sent[device] = decode_tensors(payload)
        return super().send_payload(device, payload, manifest)

    def start(self, on_message, on_payload, on_refused=None) -> None:  # type: ignore[no-untyped-def]
        def intercept(device: str, received: Received) -> None:
            if device == "bad":
                trained, sent = decode_tensors(received.data), self.sent[device]
                tensors = {k: 2 * sent[k] - v if v.is_floating_point() else v for k, v in trained.items()}
                received = received.replaced(data=encode_tensors(tensors))
            on_payload(device, received)

        super().start(on_message, intercept, on_refused)


@pytest.mark.slow
def test_a_sign_flipped_device_is_refused_from_round_two_on_and_the_fleet_learns(caplog) -> None:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["bad", "g1", "g2", "g3"])
    link = SignFlipLink([LocalDevice(c.client_id, c.train, c.test) for c in clients])
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    test = (data.test_x, data.test_y)
    with caplog.at_level(logging.WARNING, logger="fedfleet.engine"):
        train = TrainConfig(batch_size=32, lr=0.05)
        limits = {"direction_min_cosine": 0, "peer_min_cosine": None}  # last round's direction alone
        result = simulate(strategy, clients, 3, train, test, data.train_x, link=link, limits=limits)
    assert [set(r.upload_bytes) for r in result.rounds] == [{"bad", "g1", "g2", "g3"}] + [{"g1", "g2", "g3"}] * 2
    refusals = [r.getMessage() for r in caplog.records if "rejected bad's update" in r.getMessage()]
    # A busy host can re-send bad its round before the round closes (it trains and is refused again): count rounds.
    assert {int(m.split("for round ")[1].split()[0]) for m in refusals} == {2, 3}
    assert all("(wrong_direction)" in message for message in refusals)
    assert not [r for r in caplog.records if "rejected g" in r.getMessage()]  # no honest device refused
    assert result.final.accuracy is not None and result.final.accuracy > 0.5


def test_the_peer_check_names_an_update_against_its_round_only_with_enough_peers() -> None:
    gate = UploadGate(GateSettings(peer_min_updates=4))
    for i, device in enumerate(["h0", "h1", "bad", "h2"]):
        gate.sent(device, squared_norms(SENT), SENT)
        upload = flipped(9) if device == "bad" else honest(i)
        gate.accepted(1.0, gate.norm(device, 1.0, upload), device)
        if len(gate.peer_cosines()) < 4:
            assert gate.peer_cosines() == {}  # three updates do not make a reference yet
    cosines = gate.peer_cosines()
    assert cosines["bad"] < -0.5 and min(c for d, c in cosines.items() if d != "bad") > 0.3
    assert list(gate.peer_outliers()) == ["bad"]
    why = gate.peer_outliers()["bad"]
    assert "with the sum of the round's other updates (at least " in why and "below -0.2 where the round's" in why
    gate.open_round()
    assert gate.peer_cosines() == {}  # a new round, new peers


def pulling(seed: int) -> dict[str, torch.Tensor]:
    """An update that follows the fleet's drift only partly: its own data pull it elsewhere (a backdoor's, or an
    unusual shard's), every round."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * (0.3 * DRIFT[k] + 0.5 * torch.randn(v.shape, generator=generator)) for k, v in SENT.items()}


def test_a_device_that_pulls_away_every_round_is_refused_by_its_record_from_a_later_round() -> None:
    gate = UploadGate(GateSettings(peer_outlier_deviations=None))  # the record alone (the one-round cut: off)
    verdicts = []
    for round_ in range(4):
        gate.open_round()
        for i, device in enumerate(["h0", "h1", "h2", "h3", "h4", "pull"]):
            gate.sent(device, squared_norms(SENT), SENT)
            upload = pulling(10 * round_ + i) if device == "pull" else honest(10 * round_ + i)
            gate.accepted(1.0, gate.norm(device, 1.0, upload), device)
        verdicts.append(gate.peer_outliers())
        assert gate.peer_outliers() == verdicts[-1]  # judged once: asking again adds nothing to the records
    assert verdicts[0] == {}  # one round alone: an unusual device, not refused
    assert all(list(v) == ["pull"] for v in verdicts[1:])
    assert "under their rounds' median cosine with the others, on average over its last rounds" in verdicts[-1]["pull"]
    assert gate.records.score("pull") < -0.2 < 0 < min(gate.records.score(f"h{i}") + 0.1 for i in range(5))


@pytest.mark.slow
def test_by_default_a_sign_flipped_device_is_refused_at_every_close_from_round_one(caplog, tmp_path) -> None:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["bad", "g1", "g2", "g3"])
    link = SignFlipLink([LocalDevice(c.client_id, c.train, c.test) for c in clients])
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    with caplog.at_level(logging.WARNING, logger="fedfleet.engine"):
        train = TrainConfig(batch_size=32, lr=0.05)
        result = simulate(strategy, clients, 3, train, (data.test_x, data.test_y), data.train_x, link=link)
    assert [set(r.upload_bytes) for r in result.rounds] == [{"g1", "g2", "g3"}] * 3
    refusals = [r.getMessage() for r in caplog.records if "refused bad's update at the close" in r.getMessage()]
    assert len(refusals) == 3 and all("with the sum of the round's other updates" in m for m in refusals)
    assert not [r for r in caplog.records if "refused g" in r.getMessage() or "rejected g" in r.getMessage()]
    assert result.final.accuracy is not None and result.final.accuracy > 0.5
