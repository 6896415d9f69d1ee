"""The agent's side of secure aggregation: SecureRounds answers each stage over the SecAgg control message and
sends the update masked, whenever training ends relative to the neighbours' shares."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_agent.agent.secure import (
    CLAMPED_VALUES,
    Entry,
    Layout,
    SecureRounds,
    layout_vector,
    unwrap,
    update_vector,
    vector_keys,
    wrap,
)
from device_agent.secagg import Params, ServerProtocol, Session
from device_agent.secagg.auth import HmacAuth
from device_agent.secagg.errors import ProtocolViolation
from device_agent.secagg.messages import decode
from device_agent.wire.messages import SecAgg, encode, parse_message
from device_agent.wire.protocol import pack_upload

DEVICES = ("d0", "d1", "d2", "d3")
KEYS = {device: f"key-{device}".encode() for device in DEVICES}
SESSION = Session("lab", "run-1", 4)
LENGTH = 50


class Fleet:
    """Four devices' SecureRounds and the coordinator's ServerProtocol, every message through its wire form."""

    def __init__(self) -> None:
        # Each device masks its update and one more value, its clamped fraction x clip.
        params = Params(DEVICES, threshold=2, neighbours=3, length=LENGTH + CLAMPED_VALUES, clip=0.5, bits=16)
        self.server = ServerProtocol(SESSION, params, HmacAuth(KEYS))
        self.uploads: dict[str, bytes] = {}
        self.devices = {
            device: SecureRounds(device, KEYS[device], self._to_server, self._upload(device)) for device in DEVICES
        }

    def _to_server(self, message: SecAgg) -> None:
        self.server.receive(unwrap(parse_message(encode(message))))  # type: ignore[arg-type]

    def _upload(self, device: str):
        def upload(run: str, round_: int, data: bytes) -> None:
            assert (run, round_) == ("run-1", 4)
            self.uploads[device] = data
            self.server.receive(decode(data))

        return upload

    def deliver(self, messages, skip: frozenset[str] = frozenset()) -> None:
        for message in messages:
            if message.device not in skip:
                wire = parse_message(encode(wrap("run-1", 4, message)))
                self.devices[message.device].on_message(wire)  # type: ignore[arg-type]


def test_the_coordinator_unmasks_the_sum_and_each_upload_is_masked() -> None:
    fleet, rng = Fleet(), np.random.default_rng(0)
    updates = {device: rng.uniform(-0.5, 0.5, LENGTH) for device in DEVICES}
    fleet.deliver(fleet.server.start())
    assert all(fleet.devices[d].expects("run-1", 4) for d in DEVICES)
    fleet.deliver(fleet.server.advance())  # neighbour keys
    fleet.devices["d0"].trained("run-1", 4, updates["d0"])  # trained before the shares came: waits for them
    assert fleet.uploads == {}
    fleet.deliver(fleet.server.advance())  # forwarded shares: d0 masks now
    assert set(fleet.uploads) == {"d0"}
    for device in DEVICES[1:]:  # the others trained after the shares came: masked at once
        fleet.devices[device].trained("run-1", 4, updates[device])
    fleet.deliver(fleet.server.advance())  # unmask requests
    fleet.server.advance()

    result = fleet.server.result
    assert result is not None and result.survivors == DEVICES
    assert np.max(np.abs(result.total[:LENGTH] - sum(updates.values()))) <= result.error_bound
    assert abs(result.total[LENGTH]) <= result.error_bound  # nothing clamped
    for device, data in fleet.uploads.items():  # what left each device is nowhere near its update
        masked = np.frombuffer(decode(data).masked, dtype="<u4").astype(np.float64)  # type: ignore[attr-defined]
        assert not np.allclose(masked[:LENGTH], np.rint((updates[device] + 0.5) / (1 / (2**16 - 1))))


def test_a_device_that_drops_after_masking_is_still_in_the_sum() -> None:
    fleet, rng = Fleet(), np.random.default_rng(1)
    updates = {device: rng.uniform(-0.5, 0.5, LENGTH) for device in DEVICES}
    fleet.deliver(fleet.server.start())
    fleet.deliver(fleet.server.advance())
    fleet.deliver(fleet.server.advance())
    for device in DEVICES:
        fleet.devices[device].trained("run-1", 4, updates[device])
    fleet.deliver(fleet.server.advance(), skip=frozenset({"d3"}))  # d3 never answers the unmask request
    fleet.server.advance()

    assert fleet.server.result is not None
    total, bound = fleet.server.result.total, fleet.server.result.error_bound
    assert np.max(np.abs(total[:LENGTH] - sum(updates.values()))) <= bound


def test_the_sum_carries_the_devices_clamped_fractions_and_no_one_s_own() -> None:
    fleet, rng = Fleet(), np.random.default_rng(2)
    updates = {device: rng.uniform(-0.4, 0.4, LENGTH) for device in DEVICES}
    updates["d1"][:5] = 0.9  # 5 of d1's 50 values past clip 0.5: clamped to it before masking
    fleet.deliver(fleet.server.start())
    fleet.deliver(fleet.server.advance())
    fleet.deliver(fleet.server.advance())
    for device in DEVICES:
        fleet.devices[device].trained("run-1", 4, updates[device])
    fleet.deliver(fleet.server.advance())
    fleet.server.advance()

    result = fleet.server.result
    assert result is not None
    assert result.total[LENGTH] / 0.5 == pytest.approx(5 / LENGTH, abs=result.error_bound / 0.5)  # 0.1 summed
    clamped = sum(u[:5] for d, u in updates.items() if d != "d1") + 0.5  # d1's values entered the sum as 0.5
    assert np.max(np.abs(result.total[:5] - clamped)) <= result.error_bound


def test_a_redelivered_setup_is_answered_once_and_a_stray_message_drops_only_that_device() -> None:
    fleet = Fleet()
    setups = fleet.server.start()
    fleet.deliver(setups)
    fleet.deliver(setups[:1])  # redelivered: answering with fresh keys would contradict the first answer
    keys = fleet.server.advance()
    assert len(keys) == len(DEVICES)

    stray = wrap("run-1", 4, keys[1])  # d1's neighbour keys, delivered to d0
    fleet.devices["d0"].on_message(stray)

    assert not fleet.devices["d0"].expects("run-1", 4)  # d0 dropped out of this run, its peers did not
    assert fleet.devices["d1"].expects("run-1", 4)


def test_a_body_that_is_not_a_protocol_message_is_refused() -> None:
    rounds = SecureRounds("d0", None, lambda _m: pytest.fail("answered"), lambda *_a: pytest.fail("uploaded"))
    rounds.on_message(SecAgg(run="run-1", round=4, body="AAAA"))
    assert not rounds.expects("run-1", 4)


def test_the_update_vector_is_trained_minus_sent_over_trainable_float_tensors_in_key_order() -> None:
    sent = {
        "b.weight": torch.zeros(2),
        "a.weight": torch.ones(2, 2),
        "bn.running_mean": torch.zeros(3),
        "bn.num_batches_tracked": torch.tensor(0),
    }
    trained = {**sent, "b.weight": torch.tensor([0.5, -0.25]), "a.weight": torch.full((2, 2), 1.125)}

    assert vector_keys(sent) == ["a.weight", "b.weight"]
    assert update_vector(sent, trained).tolist() == [0.125] * 4 + [0.5, -0.25]


def test_a_width_slice_goes_into_the_full_tensor_at_its_index_with_zeros_elsewhere() -> None:
    sent = {"w": torch.zeros(2, 2), "fc.weight": torch.zeros(3, 2)}
    trained = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "fc.weight": torch.ones(3, 2)}
    upload = pack_upload(trained, {"classes": torch.tensor([0, 2])})  # this device saw classes 0 and 2 only
    layout = Layout(
        entries=(
            Entry(key="w", shape=(3, 4), index=((0, 2), (1, 3))),  # rows 0 and 2, columns 1 and 3 of a 3x4
            Entry(key="fc.weight", shape=(3, 4), index=(None, (0, 1)), by_class=True),
            Entry(key="fc.weight", shape=(3, 4), index=(None, (0, 1)), count=True, by_class=True),
        )
    )

    vector = layout_vector(layout, sent, upload, clip=0.5)

    assert vector[:12].reshape(3, 4).tolist() == [[0, 1, 0, 2], [0, 0, 0, 0], [0, 3, 0, 4]]
    assert vector[12:24].reshape(3, 4).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]  # class 1: zero
    assert vector[24:].reshape(3, 4).tolist() == [[0.5, 0.5, 0, 0], [0, 0, 0, 0], [0.5, 0.5, 0, 0]]  # clip per held
    assert layout.length == len(vector) == 36


def test_a_low_rank_layer_is_masked_as_its_dense_update() -> None:
    generator = torch.Generator().manual_seed(0)
    sent = {"l.reduce": torch.randn(2, 4, generator=generator), "l.expand": torch.randn(3, 2, generator=generator)}
    trained = {key: value + 0.1 for key, value in sent.items()}
    layout = Layout(entries=(Entry(key="l.weight", shape=(3, 4), factors=("l.reduce", "l.expand")),))

    vector = layout_vector(layout, sent, trained, clip=0.5)

    dense = (
        trained["l.expand"].double() @ trained["l.reduce"].double()
        - sent["l.expand"].double() @ sent["l.reduce"].double()
    )
    assert np.allclose(vector, dense.reshape(-1).numpy())


def test_a_slice_that_does_not_fit_its_index_is_refused() -> None:
    layout = Layout(entries=(Entry(key="w", shape=(3, 4), index=((0,), None)),))
    with pytest.raises(ProtocolViolation, match="does not fit the layout's index"):
        layout_vector(layout, {"w": torch.zeros(2, 4)}, {"w": torch.ones(2, 4)}, clip=0.5)
