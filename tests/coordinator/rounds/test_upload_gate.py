"""The upload gate: a broken or hostile upload is refused and logged, the round goes on, nothing of it counts.

The fleet is in-process (the engine behind an :class:`InProcessLink`), one device of which
tampers with what it sends after training, as a compromised or buggy device would.
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from coordinator.algorithms.aggregation import UpdateRejected
from coordinator.config.fleet import Device
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.rounds.engine import DeviceState, OpenRound, Participant, refusal_reason
from coordinator.rounds.upload_gate import (
    GateSettings,
    UploadGate,
    UploadRefused,
    check_dtypes,
    profile_problem,
    squared_norms,
)
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.transport.local_link import InProcessLink, LocalDevice
from device_agent.agent.probe import probe_device
from device_agent.clients.base import is_norm_statistic
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.transfer import Completed, make_manifest
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)


class TamperingLink(InProcessLink):
    """Device ``bad`` rewrites its update (tensors or meta) after it trained."""

    def __init__(self, devices: list[LocalDevice], tamper) -> None:
        super().__init__(devices)
        self.tamper = tamper

    def start(self, on_message, on_payload, on_refused=None) -> None:
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
    return digit_clients(["bad", "good"])


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
    monkeypatch.setattr(
        "coordinator.emulation.simulation.InProcessLink", lambda devices: TamperingLink(list(devices), tamper)
    )
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


# ---- the gate's own checks (coordinator.rounds.upload_gate) ------------------------------------------


def test_every_upload_dtype_but_float32_and_integers_is_refused_before_any_arithmetic() -> None:
    check_dtypes({"w": torch.zeros(2), "classes": torch.tensor([1, 2])})
    for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.bool, torch.complex64):
        with pytest.raises(UploadRefused, match=re.escape(f"'w': dtype {dtype}")) as refused:
            check_dtypes({"w": torch.zeros(2).to(dtype)})
        assert refused.value.reason == "bad_dtype"


def test_a_fedhm_update_must_hold_exactly_what_its_level_sends() -> None:
    strategy = build_strategy("fedhm", CNN, {}, seed=0)
    slots = [ClientSlot("a", 0.5, 100)]
    round_ = strategy.open_round(1, slots)
    sent = strategy.configure(1, slots)["a"].tensors
    upload = {k: v for k, v in sent.items() if not is_norm_statistic(k)}
    round_.check("a", upload, 100)  # what an honest client at gamma 1/2 sends
    one = dict(list(upload.items())[:1])
    with pytest.raises(UpdateRejected, match="missing from the upload") as refused:
        round_.check("a", one, 100)
    assert refused.value.reason == "missing_tensor"
    key = next(iter(upload))
    with pytest.raises(UpdateRejected, match=re.escape(f"{key!r}: dtype torch.float64")) as refused:
        round_.check("a", {**upload, key: upload[key].double()}, 100)
    assert refused.value.reason == "bad_dtype"


@pytest.mark.parametrize(
    ("meta", "problem"),
    [
        ({"train_seconds": "1e30"}, "train_seconds=1e+30 exceeds the bound"),
        ({"loss": "1e300"}, "loss=1e+300 exceeds the bound"),
        ({"samples": "100001"}, "samples=100001 is over 100x the 1000 expected"),
        ({"samples": "0"}, "samples=0"),
        ({"local_accuracy": "3"}, "local_accuracy=3.0 is not in [0, 1]"),
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
    assert gate.norm("a", 1.0, {"w": sent["w"] * 3}) == pytest.approx(3.0)
    with pytest.raises(UploadRefused, match="is 20x its reference") as refused:
        gate.norm("a", 1.0, {"w": sent["w"] * 20})
    assert refused.value.reason == "norm_too_large"
    # Nothing sent to compare with (a kept personalized part): the first upload of a level passes, then the median.
    assert gate.norm("b", 0.5, {"v": torch.full((100,), 5.0)}) == pytest.approx(50.0)
    gate.accepted(0.5, 50.0)
    with pytest.raises(UploadRefused, match="its reference 50"):
        gate.norm("c", 0.5, {"v": torch.full((100,), 60.0)})
    assert UploadGate(GateSettings(max_norm_ratio=None)).norm("a", 1.0, {"w": torch.full((4,), 1e5)}) > 0


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
