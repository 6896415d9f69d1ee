"""The upload gate: a broken or hostile upload is refused and logged, the round goes on, nothing of it counts.

The fleet is in-process (the engine behind an :class:`MemoryLink`), one device of which
tampers with what it sends after training, as a compromised or buggy device would.
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import yaml

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.fleet import Device, parse_fleet
from coordinator.emulation.simulation import SimClient, fixed_levels, simulate, simulation_fleet
from coordinator.rounds.engine import DeviceState, EngineSettings, OpenRound, Participant, RoundEngine, refusal_reason
from coordinator.rounds.signing import UploadSignatures
from coordinator.rounds.upload_gate import (
    GateSettings,
    Screened,
    UploadGate,
    UploadRefused,
    profile_problem,
    squared_norms,
)
from coordinator.run.rundir import RunDir
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.agent.probe import probe_device
from device_agent.agent.signing import UploadIdentity, signed_meta
from device_agent.clients.base import is_norm_statistic
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.messages import Error
from device_agent.wire.payload import Received
from device_agent.wire.transfer import new_transfer_id
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)


class TamperingLink(MemoryLink):
    """Device ``bad`` rewrites its update (tensors or meta) after it trained."""

    def __init__(self, devices: list[LocalDevice], tamper) -> None:
        super().__init__(devices)
        self.tamper = tamper

    def start(self, on_message, on_payload, on_refused=None) -> None:
        def intercept(device: str, received: Received) -> None:
            if device == "bad":
                tensors, meta = self.tamper(decode_tensors(received.data), dict(received.meta))
                received = received.replaced(data=encode_tensors(tensors), meta=meta)
            on_payload(device, received)

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


def overflowing_global_loss(tensors, meta):
    """A valid update whose federated evaluation would overflow the round's weighted loss to inf."""
    return tensors, {**meta, "global_accuracy": "0.5", "global_loss": "1.7e308", "eval_samples": str(2**53)}


def unknown_extra(tensors, meta):
    tensors["__extra__.junk"] = torch.zeros(1000)
    return tensors, meta


def missing_layer(tensors, meta):
    del tensors["conv1.weight"]
    return tensors, meta


@pytest.fixture(scope="module")
def clients() -> list[SimClient]:
    return digit_clients(["bad", "good"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (nan_weights, "'fc.weight': contains NaN or infinite values"),
        (huge_weights, "'fc.weight': a value of magnitude 3e+38 exceeds the bound"),
        (nan_loss, "loss=nan is not a finite number"),
        (bad_global_accuracy, "global_accuracy=1.5 is outside [0, 1]"),
        (overflowing_global_loss, "global_loss=1.7e+308 is outside"),
        (unknown_extra, "'junk': side information this strategy does not take (none)"),
        (missing_layer, "conv1.weight"),
    ],
)
def test_a_bad_upload_is_refused_logged_and_never_folded(clients, tamper, reason, caplog) -> None:
    data = load_dataset("digits", 8, 1)
    link = TamperingLink([LocalDevice(c.client_id, c.train, c.test) for c in clients], tamper)
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    test = (data.test_x, data.test_y)
    with caplog.at_level(logging.WARNING, logger="fedfleet.engine"):
        result = simulate(strategy, clients, 2, TrainConfig(batch_size=32), test, data.train_x, link=link)
    assert [r.round for r in result.rounds] == [1, 2]  # the rounds went on
    for record in result.rounds:
        assert set(record.upload_bytes) == {"good"}  # only the good device counted
    assert all(torch.isfinite(v).all() for v in strategy.global_state().values() if v.is_floating_point())
    assert result.final.accuracy > 0.5
    refusals = [r.getMessage() for r in caplog.records if "rejected bad's update" in r.getMessage()]
    assert len(refusals) == 2 and all(reason in message for message in refusals)


@pytest.mark.slow
def test_a_simulation_whose_every_upload_is_refused_reports_its_failed_rounds() -> None:
    data = load_dataset("digits", 8, 1)
    clients = digit_clients(["bad"])
    link = TamperingLink([LocalDevice(c.client_id, c.train, c.test) for c in clients], nan_weights)
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    test = (data.test_x, data.test_y)
    result = simulate(strategy, clients, 2, TrainConfig(batch_size=32), test, data.train_x, link=link)
    assert result.failed_rounds == [1, 2]
    assert all(not record.upload_bytes for record in result.rounds)


# ---- the gate's own checks (coordinator.rounds.upload_gate) ------------------------------------------


def test_a_fedhm_update_must_hold_exactly_what_its_level_sends() -> None:
    strategy = build_strategy("fedhm", CNN, {}, seed=0)
    slot = ClientSlot("a", 0.5, 100)
    sent = strategy.configure(1, [slot])["a"].tensors
    upload = {k: v for k, v in sent.items() if not is_norm_statistic(k)}
    contract = strategy.upload_contract(slot)
    contract.check(upload)  # what an honest client at gamma 1/2 sends
    one = dict(list(upload.items())[:1])
    with pytest.raises(UpdateRejected, match="missing from the upload") as refused:
        contract.check(one)
    assert refused.value.reason == "missing_tensor"
    key = next(iter(upload))
    for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool, torch.complex64):
        expected = re.escape(f"{key!r}: dtype {dtype}, expected torch.float32")
        with pytest.raises(UpdateRejected, match=expected) as refused:
            contract.check({**upload, key: upload[key].to(dtype)})
        assert refused.value.reason == "bad_dtype"


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"train_seconds": "1e30"}, "train_seconds=1e+30 is outside [0, 86400]"),
        ({"loss": "1e300"}, "loss=1e+300 is outside [-1e+06, 1e+06]"),
        ({"samples": "100001"}, "samples=100001 is over 100x the 1000 expected"),
        ({"samples": "0"}, "samples=0"),
        ({"local_accuracy": "3"}, "local_accuracy=3.0 is outside [0, 1]"),
        ({"global_accuracy": "0.5", "global_loss": "1", "eval_samples": "100001"}, "eval_samples=100001 is over 100x"),
        ({f"x{i}": "1" for i in range(20)}, "entries (at most 16)"),
        ({"note": "x" * 300}, "is over 256 characters"),
    ],
)
def test_absurd_meta_is_refused_with_a_reason(meta, problem) -> None:
    honest = {"samples": "900", "train_seconds": "3.5", "loss": "0.4"}
    gate = UploadGate()
    assert gate.meta(honest, expected_samples=1000).samples == 900
    with pytest.raises(ValueError, match=re.escape(problem)) as refused:
        gate.meta({**honest, **meta}, expected_samples=1000)
    assert refusal_reason(refused.value) == "bad_meta"


def test_the_norm_bound_compares_with_what_was_sent_else_the_level_median() -> None:
    gate = UploadGate(GateSettings(max_norm_ratio=10))
    sent = {"w": torch.full((100,), 0.1)}  # norm 1
    gate.sent("a", squared_norms(sent))
    assert gate.norm("a", 1.0, {"w": sent["w"] * 3}).norm == pytest.approx(3.0)
    with pytest.raises(UploadRefused, match="is 20x its reference") as refused:
        gate.norm("a", 1.0, {"w": sent["w"] * 20})
    assert refused.value.reason == "norm_too_large"
    # Nothing sent to compare with (a kept personalized part): the first upload of a level passes, then the median.
    assert gate.norm("b", 0.5, {"v": torch.full((100,), 5.0)}).norm == pytest.approx(50.0)
    gate.accepted(0.5, Screened({}, 50.0))
    with pytest.raises(UploadRefused, match="its reference 50"):
        gate.norm("c", 0.5, {"v": torch.full((100,), 60.0)})
    assert UploadGate(GateSettings(max_norm_ratio=None)).norm("a", 1.0, {"w": torch.full((4,), 1e5)}).norm > 0


def test_gate_settings_and_reasons_are_checked() -> None:
    with pytest.raises(ValueError, match="max_norm_ratio must be > 1"):
        GateSettings(max_norm_ratio=0.5)
    with pytest.raises(ValueError, match="unknown refusal reason 'oops'"):
        UploadRefused("oops", "x")


def test_a_hello_profile_with_infinite_compute_is_named() -> None:
    profile = probe_device(0.01)
    assert profile_problem(profile) is None
    broken = profile.model_copy(update={"compute": profile.compute.model_copy(update={"fp32_gflops": math.inf})})
    assert profile_problem(broken) == "a non-finite profile value (compute.fp32_gflops = inf)"


def test_a_fresh_refusal_is_no_answer_until_its_grace_has_passed() -> None:
    devices = {"a": DeviceState(Device(id="a", profile="x"), online=True)}
    open_ = OpenRound(1, {"a": Participant(1.0, status="rejected", rejected_at=100.0)}, None, 0.0, 0.0)  # type: ignore[arg-type]
    assert not open_.answered(devices, rejected_before=99.0)  # it may still send a valid update
    assert open_.answered(devices, rejected_before=100.0)


class ForgingLink(MemoryLink):
    """Devices sign their updates; right after the first genuine one, a login holder resends it claiming 100x samples.

    The forgery follows the first update, not the last: events are applied in order, so it is answered while the
    round still waits for the other device (after the last update the round may close before it is read).
    """

    def __init__(self, devices: list[LocalDevice], key: bytes) -> None:
        super().__init__(devices)
        self.key = key
        self.answers: list[tuple[str, object]] = []
        self.forged: set[str] = set()
        self.forger: str | None = None

    def start(self, on_message, on_payload, on_refused=None) -> None:
        def sign_then_forge(device: str, received: Received) -> None:
            assert received.digest is not None
            identity = UploadIdentity(
                "simulation", received.run, received.round, device, received.transfer, received.digest.value
            )
            signed = received.replaced(meta=signed_meta(received.meta, self.key, identity))
            on_payload(device, signed)
            if self.forger is None:
                self.forger = device
                reweighted = {**signed.meta, "samples": str(int(received.meta["samples"]) * 100)}
                forged = signed.replaced(meta=reweighted, transfer=new_transfer_id())
                self.forged.add(forged.transfer)
                on_payload(device, forged)

        super().start(on_message, sign_then_forge, on_refused)

    def send_control(self, device: str, message) -> None:
        self.answers.append((device, message))
        super().send_control(device, message)


@pytest.mark.slow
def test_a_forged_upload_after_the_genuine_one_is_refused_not_told_duplicate(tmp_path) -> None:
    clients = digit_clients(["pi-0", "pi-1"])
    data = load_dataset("digits", 8, 1)
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    raw = simulation_fleet(strategy, clients, 1, TrainConfig(batch_size=32))
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))
    rundir = RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0)
    key = bytes(range(32))
    link = ForgingLink([LocalDevice(c.client_id, c.train, c.test) for c in clients], key)
    engine = RoundEngine(
        parse_fleet(raw, source="test"),
        {},
        strategy,
        rundir,
        data,
        link,
        EngineSettings(min_devices=2, wait_timeout_s=60, calibration_samples=len(data.train_x)),
        planner=fixed_levels({c.client_id: c.level for c in clients}),
        signatures=UploadSignatures("simulation", {"pi-0": key, "pi-1": key}),
    )
    assert engine.run()
    (closed,) = rundir.metrics()
    rundir.close()
    assert closed.participants == 2
    (answer,) = [m for d, m in link.answers if getattr(m, "transfer", None) in link.forged]
    assert isinstance(answer, Error) and answer.code == "rejected"
    assert f"does not verify with {link.forger}'s key" in answer.detail
    assert engine.refusals[(link.forger, "bad_signature")] == 1
