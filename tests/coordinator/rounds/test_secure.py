"""The coordinator's side of a secure round: SecureRound over a Link, with the agents' SecureRounds as devices."""

from __future__ import annotations

import time

import pytest
import torch

from coordinator.config.secure import SecureAggregation
from coordinator.rounds.secure import SecureRound
from coordinator.rounds.secure_layouts import FlatLayout
from coordinator.rounds.state import OpenRound, Participant
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from device_agent.agent.secure import MASKED_KIND, SecureRounds, update_vector, wrap
from device_agent.secagg import DeviceProtocol, ParameterError, Session
from device_agent.wire.messages import Message, encode, parse_message
from device_agent.wire.payload import Received

DEVICES = ["d0", "d1", "d2", "d3", "d4"]
SETTINGS = SecureAggregation(threshold=2, neighbours=4, clip=0.5, bits=16)


class Link:
    """Hands each control message to the device's SecureRounds at once, through the wire form."""

    def __init__(self) -> None:
        self.devices: dict[str, SecureRounds] = {}
        self.silent: set[str] = set()
        self.down: list[tuple[str, str]] = []

    def send_control(self, device: str, message: Message) -> None:
        self.down.append((device, message.type))
        if device not in self.silent:
            self.devices[device].on_message(parse_message(encode(message)))  # type: ignore[arg-type]


def masked(run: str, round_: int, data: bytes) -> Received:
    return Received(run=run, round=round_, kind=MASKED_KIND, transfer="0" * 32, meta={}, digest=None, data=data)


def secure_round(link: Link, sent: dict[str, torch.Tensor]) -> SecureRound:
    layout = FlatLayout(sent, [ClientSlot(d, 1.0, 100) for d in DEVICES])
    secure = SecureRound(SETTINGS, Session("lab", "run-1", 1), DEVICES, layout, link, stage_s=0.05)  # type: ignore[arg-type]
    for device in DEVICES:
        link.devices[device] = SecureRounds(
            device,
            None,
            lambda message, device=device: secure.on_message(device, parse_message(encode(message))),  # type: ignore[arg-type]
            lambda run, round_, data, device=device: secure.on_masked(
                device,
                Received(run=run, round=round_, kind=MASKED_KIND, transfer="0" * 32, meta={}, digest=None, data=data),
            ),
        )
    return secure


def test_a_device_silent_from_the_start_is_left_out_and_the_round_averages_the_rest() -> None:
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    slots = [ClientSlot(d, 1.0, 100) for d in DEVICES]
    sent = strategy.configure(1, slots)["d0"].tensors
    link = Link()
    link.silent.add("d4")
    secure = secure_round(link, sent)

    secure.start()
    while not secure.keys_exchanged:  # d4 never answers: the key stages close at their deadline without it
        time.sleep(0.01)
        secure.tick(time.monotonic() + 60)
    assert secure.members == frozenset(DEVICES[:4])

    generator = torch.Generator().manual_seed(0)
    updates = {}
    for device in DEVICES[:4]:  # each trains, then masks: the last one's masked input ends the stage
        trained = {
            k: v + 0.01 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
            for k, v in sent.items()
        }
        updates[device] = update_vector(sent, trained)
        link.devices[device].trained("run-1", 1, updates[device])
    assert secure.finished and secure.result is not None and secure.result.survivors == tuple(DEVICES[:4])

    open_ = OpenRound(
        1, {d: Participant(1.0) for d in DEVICES}, strategy.open_round(1, slots), time.monotonic() + 60, 0
    )
    secure.fold_into(open_.aggregate, open_)
    before = {k: v.clone() for k, v in strategy.global_state().items()}
    strategy.close_round(open_.aggregate)

    assert open_.accepted == DEVICES[:4] and open_.participants["d4"].status == "assigned"
    mean = sum(updates.values()) / 4
    moved = torch.cat([(strategy.global_state()[k] - before[k]).double().reshape(-1) for k in secure.layout.keys])
    assert float((moved - torch.from_numpy(mean)).abs().max()) <= SETTINGS.clip / (2**SETTINGS.bits - 1) + 1e-6
    # The coordinator sent d4 only its Setup; the protocol's other messages went to the four that answered.
    assert [kind for device, kind in link.down if device == "d4"] == ["secagg"]


def test_a_message_naming_another_device_is_dropped() -> None:
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    sent = strategy.configure(1, [ClientSlot(d, 1.0, 100) for d in DEVICES])["d0"].tensors
    link = Link()
    link.silent.update(DEVICES)
    secure = secure_round(link, sent)
    setup = next(m for m in secure.server.start() if m.device == "d1")
    keys = DeviceProtocol("d1").advertise(setup)

    secure.on_message("d2", wrap("run-1", 1, keys))  # d1's keys, sent on d2's login

    assert secure.server.pending() == frozenset(DEVICES)
    secure.on_message("d1", wrap("run-1", 1, keys))
    assert secure.server.pending() == frozenset(DEVICES) - {"d1"}


def test_a_round_that_drew_fewer_devices_connects_each_to_all_others_and_keeps_the_threshold() -> None:
    strategy = build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0)
    sent = strategy.configure(1, [ClientSlot("d0", 1.0, 100)])["d0"].tensors
    settings = SecureAggregation(threshold=3, neighbours=4)

    layout = FlatLayout(sent, [ClientSlot("d0", 1.0, 100)])
    secure = SecureRound(settings, Session("lab", "run-1", 1), ["d0", "d1", "d2", "d3"], layout, Link())  # type: ignore[arg-type]

    assert (secure.server.params.neighbours, secure.server.params.threshold) == (3, 3)
    with pytest.raises(ParameterError, match="threshold"):
        SecureRound(settings, Session("lab", "run-1", 1), ["d0", "d1", "d2"], layout, Link())  # type: ignore[arg-type]
