"""The upload gate's update bound: -9.5x the weights sent passes the old 10x bound, not this one."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from coordinator.config.fleet import parse_fleet
from coordinator.config.limits import GateSettings
from coordinator.emulation.simulation import fixed_levels, simulation_fleet
from coordinator.rounds.admission import Admission
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.rounds.state import OpenRound, Participant
from coordinator.rounds.upload_gate import UploadGate, UploadRefused, sample_scale, squared_norms
from coordinator.run.rundir import RunDir
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.clients.base import is_norm_statistic
from device_agent.clients.spec import TrainConfig
from device_agent.data.datasets import load_dataset
from device_agent.wire.codec import encode_tensors
from device_agent.wire.payload import Received
from device_agent.wire.protocol import UPDATE_KIND
from device_agent.wire.transfer import Completed, make_manifest
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)

SENT = {"w": torch.ones(100), "b": torch.zeros(10)}


def honest(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in SENT.items()}


def warmed_gate(settings: GateSettings) -> UploadGate:
    """A gate whose last round accepted three honest updates (layer update norms ~0.1 and ~0.03)."""
    gate = UploadGate(settings)
    for i in range(3):
        gate.sent(f"h{i}", squared_norms(SENT), SENT)
        gate.accepted(1.0, gate.norm(f"h{i}", 1.0, honest(i)), f"h{i}")
    gate.open_round()
    gate.sent("bad", squared_norms(SENT), SENT)
    return gate


def test_minus_nine_and_a_half_times_the_weights_is_clipped_to_three_times_the_median_update() -> None:
    gate = warmed_gate(GateSettings())
    median = gate.history.median("w")
    screened = gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()})
    assert screened.steps["w"] < 0.1  # its update of 10.5 x the weights kept only a fraction
    assert screened.update_norms["w"] == pytest.approx(3 * median, rel=1e-4)
    assert screened.upload["w"].shape == SENT["w"].shape
    assert "b" not in screened.steps  # -9.5 x zeros is no update at all
    assert gate.norm("bad", 1.0, honest(7)).steps == {}  # an honest update passes untouched


LAYERS = {f"l{i}": torch.ones(100) for i in range(8)}


def layered(seed: int, boost: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """An honest update of eight layers (each of norm ~0.1), the layers in ``boost`` scaled by their factor."""
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + (boost or {}).get(k, 1.0) * 0.01 * torch.randn(v.shape, generator=generator) for k, v in LAYERS.items()
    }


def layered_gate() -> UploadGate:
    """A gate whose last round accepted five honest eight-layer updates of devices with the expected samples."""
    gate = UploadGate(GateSettings())
    for i in range(5):
        gate.sent(f"h{i}", squared_norms(LAYERS), LAYERS)
        gate.accepted(1.0, gate.norm(f"h{i}", 1.0, layered(i)), f"h{i}")
    gate.open_round()
    return gate


def test_one_layer_of_an_honest_update_may_jump_where_an_update_boosted_in_every_layer_is_clipped() -> None:
    """The bound holds the update as a whole (the root mean square of its layers' ratios) at 3x the fleet's median,
    each layer alone at 6x: an honest update with one layer at 4x passes untouched (the demo's orin-02 had conv3 at
    3.6x with the rest of its update at 2x), the same update boosted 4x everywhere is clipped to 3x in each layer."""
    gate = layered_gate()
    gate.sent("jump", squared_norms(LAYERS), LAYERS)
    jump = layered(7, {"l0": 4.0})
    assert gate.norm("jump", 1.0, jump).steps == {}
    gate.sent("boost", squared_norms(LAYERS), LAYERS)
    screened = gate.norm("boost", 1.0, layered(7, {name: 4.0 for name in LAYERS}))
    ratios = [screened.update_norms[name] / gate.history.median(name) for name in LAYERS]
    assert set(screened.steps) == set(LAYERS) and sum(r * r for r in ratios) / len(ratios) == pytest.approx(9, rel=1e-3)
    gate.sent("one", squared_norms(LAYERS), LAYERS)
    one = gate.norm("one", 1.0, layered(7, {"l0": 9.5}))  # one layer boosted: held at 6x by the bound per layer
    assert set(one.steps) == {"l0"} and one.update_norms["l0"] == pytest.approx(6 * gate.history.median("l0"), rel=1e-4)


def test_a_device_with_more_samples_gets_room_for_its_longer_update_and_its_norms_enter_the_median_scaled() -> None:
    """Twice the data, twice the steps: the reference grows with sqrt(samples / expected), so a device with 4x the
    expected samples may move twice as far, and its norms enter the history halved (the median stays a device's of
    the expected samples)."""
    gate = layered_gate()
    medians = {name: gate.history.median(name) for name in LAYERS}
    large = layered(8, {name: 5.0 for name in LAYERS})  # ~5x the median in every layer
    gate.sent("small", squared_norms(LAYERS), LAYERS)
    assert gate.norm("small", 1.0, large, scale=sample_scale(100, 100)).steps.keys() == LAYERS.keys()
    gate.sent("big", squared_norms(LAYERS), LAYERS)
    screened = gate.norm("big", 1.0, large, scale=sample_scale(400, 100))
    assert screened.steps == {} and screened.scale == 2.0
    gate.accepted(1.0, screened, "big")
    gate.open_round()
    window = gate.history.window()[-1]
    assert window == {name: [pytest.approx(screened.update_norms[name] / 2)] for name in LAYERS}
    assert all(gate.history.median(name) > medians[name] for name in LAYERS)  # its round joined the window
    assert sample_scale(None, 100) == sample_scale(100, None) == 1.0


def test_a_rounds_bounds_come_from_earlier_rounds_so_arrival_order_changes_nothing() -> None:
    """The bound learns from closed rounds only: an attacker arriving first gets the same bound as one arriving last,
    and a round's uploads are clipped the same whatever order they came in."""
    big = {k: SENT[k] + 10 * (v - SENT[k]) for k, v in honest(8).items()}  # 10x an honest update

    def screen(order: list[str]) -> dict[str, dict[str, float]]:
        gate = warmed_gate(GateSettings())
        uploads = {"h7": honest(7), "big": big, "h9": honest(9)}
        steps = {}
        for device in order:
            gate.sent(device, squared_norms(SENT), SENT)
            screened = gate.norm(device, 1.0, uploads[device])
            gate.accepted(1.0, screened, device)
            steps[device] = screened.steps
        return steps

    first, last = screen(["big", "h7", "h9"]), screen(["h7", "h9", "big"])
    assert first == last and first["big"]["w"] < 0.5 and first["h7"] == first["h9"] == {}


def moved(seed: int, factor: float) -> dict[str, torch.Tensor]:
    """:func:`honest`'s update of ``seed`` scaled by ``factor``."""
    return {k: SENT[k] + factor * (v - SENT[k]) for k, v in honest(seed).items()}


def converged_gate(settings: GateSettings) -> UploadGate:
    """A gate whose fleet moved ~0.1 (layer "w") in its first round and a tenth of that in the five rounds since."""
    gate = warmed_gate(settings)
    for round_ in range(5):
        for i in range(3):
            gate.sent(f"h{i}", squared_norms(SENT), SENT)
            gate.accepted(1.0, gate.norm(f"h{i}", 1.0, moved(10 * round_ + i, 0.1)), f"h{i}")
        gate.open_round()
    return gate


def test_a_converged_fleets_collapsed_median_does_not_clip_a_device_moving_as_far_as_the_fleet_once_did() -> None:
    """As a model converges most devices barely move; one the model still fits worse moves about as far as the fleet
    did early on (the soak: 3-10x the round's median, about the first rounds' median). The reference never falls
    below 0.75 of the highest median of the run, so that device passes, while 9.5x it is still clipped, to 3x the
    floor."""
    gate = converged_gate(GateSettings())
    median, peak = gate.history.median("w"), gate.history.peak("w")
    assert median is not None and median < 0.15 * peak  # collapsed: the window holds only the converged rounds
    gate.sent("slow", squared_norms(SENT), SENT)
    assert gate.norm("slow", 1.0, honest(99)).steps == {}  # ~10x the median, ~1x the peak
    gate.sent("boost", squared_norms(SENT), SENT)
    boosted = gate.norm("boost", 1.0, moved(99, 9.5))
    assert boosted.steps and boosted.update_norms["w"] == pytest.approx(3 * 0.75 * peak, rel=1e-3)

    median_alone = converged_gate(GateSettings(update_reference_floor=None))
    median_alone.sent("slow", squared_norms(SENT), SENT)
    assert median_alone.norm("slow", 1.0, honest(99)).steps  # the median alone clips it to 3x its collapsed value
    with pytest.raises(ValueError, match=r"update_reference_floor must be in \(0, 1\]"):
        GateSettings(update_reference_floor=1.5)


def test_norms_refused_at_the_close_never_join_the_median() -> None:
    gate = warmed_gate(GateSettings())
    median = gate.history.median("w")
    gate.accepted(1.0, gate.norm("bad", 1.0, {k: SENT[k] + 1.5 * (v - SENT[k]) for k, v in honest(8).items()}), "bad")
    gate.refused_at_close("bad")
    gate.open_round()
    assert gate.history.median("w") == median  # the previous round's three, not the refused fourth


def test_the_weak_noise_is_z_times_the_median_update_over_the_updates_folded() -> None:
    gate = warmed_gate(GateSettings(update_noise=0.1))
    median = gate.history.median_update_norm()
    assert median is not None and gate.noise_std(folded=4) == pytest.approx(0.1 * median / 4)
    assert UploadGate(GateSettings(update_noise=0.1)).noise_std(4) is None  # the first round: no median yet
    assert warmed_gate(GateSettings()).noise_std(4) is None  # off by default


def test_with_refuse_the_same_upload_is_refused_naming_the_layer() -> None:
    gate = warmed_gate(GateSettings(update_bound_action="refuse"))
    with pytest.raises(UploadRefused, match="'w': update norm 105 is over its bound") as refused:
        gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()})
    assert refused.value.reason == "norm_too_large"


def test_before_any_median_the_update_may_move_as_far_as_the_weights_sent() -> None:
    gate = UploadGate(GateSettings())
    gate.sent("bad", squared_norms(SENT), SENT)
    screened = gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()})
    assert screened.update_norms["w"] == pytest.approx(float(SENT["w"].norm()), rel=1e-4)  # warm-up factor 1


def test_a_layer_the_fleet_left_unchanged_falls_back_to_the_warm_up_bound_not_to_zero() -> None:
    gate = UploadGate(GateSettings())
    for i in range(3):  # three devices whose uploads never move "b" (no gradient reaches it)
        gate.sent(f"h{i}", squared_norms(SENT), SENT)
        gate.accepted(1.0, gate.norm(f"h{i}", 1.0, {"w": honest(i)["w"], "b": SENT["b"]}))
    gate.open_round()
    assert gate.history.median("b") is None  # a still layer is left out of the median
    gate.sent("d", squared_norms(SENT), SENT)
    moved = {"w": honest(9)["w"], "b": SENT["b"] + 0.05}
    screened = gate.norm("d", 1.0, moved)
    assert "b" not in screened.steps  # k x 0 would have clipped it to nothing
    assert torch.equal(screened.upload["b"], moved["b"])


def test_a_majority_of_still_devices_does_not_clip_the_ones_that_learn() -> None:
    """1,000 devices over 1,437 digits: most hold one image (one class, masked loss 0) and move only by weight decay."""
    gate = UploadGate(GateSettings())
    decayed = {k: v * (1 - 0.05 * 5e-4) for k, v in SENT.items()}  # one step of weight decay, no gradient
    for i in range(7):
        gate.sent(f"still{i}", squared_norms(SENT), SENT)
        gate.accepted(1.0, gate.norm(f"still{i}", 1.0, decayed))
    for i in range(3):
        gate.sent(f"h{i}", squared_norms(SENT), SENT)
        gate.accepted(1.0, gate.norm(f"h{i}", 1.0, honest(i)))
    gate.open_round()
    gate.sent("d", squared_norms(SENT), SENT)
    learned = honest(9)
    screened = gate.norm("d", 1.0, learned)
    assert screened.steps == {} and torch.equal(screened.upload["w"], learned["w"])
    assert gate.history.median("w") == pytest.approx(float((honest(1)["w"] - SENT["w"]).norm()), rel=0.3)
    with pytest.raises(ValueError, match=r"update_still_ratio must be in \[0, 1\)"):
        GateSettings(update_still_ratio=1.0)


def test_the_bound_can_be_turned_off_and_the_sample_weight_is_capped() -> None:
    gate = warmed_gate(GateSettings(update_bound_factor=None))
    assert gate.norm("bad", 1.0, {k: -9.5 * v for k, v in SENT.items()}).steps == {}
    assert gate.sample_weight(claimed=9_700, expected_samples=100) == 200
    assert gate.sample_weight(claimed=90, expected_samples=100) == 90
    assert UploadGate(GateSettings(sample_weight_factor=None)).sample_weight(9_700, 100) == 9_700


def test_a_clipped_fedhm_upload_is_journaled_as_folded_so_a_resume_folds_the_same(tmp_path: Path) -> None:
    strategy = build_strategy("fedhm", CNN, {}, seed=0)
    (tmp_path / "fleet.yaml").write_text("fleet: lab\n")
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    slots = [ClientSlot("pi-1", 0.5, 100)]
    sent = strategy.configure(1, slots)["pi-1"].tensors
    attack = encode_tensors({k: -9.5 * v for k, v in sent.items() if not is_norm_statistic(k)})
    manifest = make_manifest(
        attack,
        run=rundir.run_id,
        round=1,
        kind=UPDATE_KIND,
        meta={"samples": "9700", "train_seconds": "2", "loss": "1"},
    )

    def fresh_round() -> tuple[Admission, OpenRound]:
        gate = UploadGate()
        gate.sent("pi-1", squared_norms(sent), sent)
        open_ = OpenRound(1, {"pi-1": Participant(0.5)}, strategy.open_round(1, slots), 1e12, 0.0)
        return Admission(gate, rundir, lambda _d: 100, contract=strategy.upload_contract), open_

    admission, open_ = fresh_round()
    assert admission.admit("pi-1", Received.of(Completed(manifest, [attack])), open_, next_round=1) == "accepted"
    folded = open_.aggregate.aggregator.result()  # type: ignore[attr-defined]
    (entry,) = rundir.resume().journal
    assert entry.meta["clipped"] and entry.meta["samples"] == 200 and entry.meta["claimed_samples"] == 9700
    clipped = open_.participants["pi-1"].clipped  # the round's metrics, the report and /metrics count it
    assert clipped is not None and 0 < clipped < 0.2
    admission, replayed = fresh_round()
    admission.replay([entry], replayed, lambda: strategy.open_round(1, slots))
    assert replayed.participants["pi-1"].clipped == pytest.approx(clipped)
    again = replayed.aggregate.aggregator.result()  # type: ignore[attr-defined]
    assert all(torch.equal(folded[k], again[k]) for k in folded)
    # The warm-up bound held: the model moved by about its own norm (SVD truncation included), not 90x it.
    before = strategy.global_state()
    keys = [k for k, v in before.items() if v.is_floating_point() and not is_norm_statistic(k)]
    moved = sum(float((folded[k] - before[k]).square().sum()) for k in keys) ** 0.5
    assert moved < 2 * sum(float(before[k].square().sum()) for k in keys) ** 0.5


def test_admission_scales_each_device_from_the_fleets_typical_samples_and_a_replay_the_same(tmp_path: Path) -> None:
    """A device with 4x the fleet's typical samples (its own expected share here: a fleet.yaml ``samples`` override)
    has its norms enter the history halved, live and replayed alike; the scale is never taken from the device's own
    expected samples, which would make every device typical."""
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    (tmp_path / "fleet.yaml").write_text("fleet: lab\n")
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    slots = [ClientSlot("big", 1.0, 400)]
    sent = strategy.configure(1, slots)["big"].tensors
    upload = encode_tensors({k: v + 0.01 for k, v in sent.items() if not is_norm_statistic(k)})
    meta = {"samples": "400", "train_seconds": "2", "loss": "1"}
    manifest = make_manifest(upload, run=rundir.run_id, round=1, kind=UPDATE_KIND, meta=meta)

    def fresh_round() -> tuple[Admission, OpenRound]:
        gate = UploadGate()
        gate.sent("big", squared_norms(sent), sent)
        open_ = OpenRound(1, {"big": Participant(1.0)}, strategy.open_round(1, slots), 1e12, 0.0)
        admission = Admission(gate, rundir, lambda _d: 400, contract=strategy.upload_contract, typical_samples=100)
        return admission, open_

    admission, open_ = fresh_round()
    assert admission.admit("big", Received.of(Completed(manifest, [upload])), open_, next_round=1) == "accepted"
    (entry,) = rundir.resume().journal
    admission.gate.open_round()
    halved = {name: [pytest.approx(norm / 2)] for name, norm in entry.meta["update_norms"].items()}
    assert admission.gate.history.window() == [halved]
    replayed, again = fresh_round()
    replayed.replay([entry], again, lambda: strategy.open_round(1, slots), lambda: {"big": sent})
    replayed.gate.open_round()
    assert replayed.gate.history.window() == [halved]


@pytest.mark.slow
def test_a_resumed_run_bounds_updates_by_the_norm_history_it_had_and_keeps_the_peer_records(tmp_path: Path) -> None:
    clients = digit_clients(["pi-0", "pi-1", "pi-2", "pi-3"])  # four: the peer check judges, records build
    data = load_dataset("digits", 8, 1)
    raw = simulation_fleet(build_strategy("fedavg", CNN, {}, seed=0), clients, 2, TrainConfig(batch_size=32))
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(raw))

    def engine(rundir: RunDir) -> RoundEngine:
        return RoundEngine(
            parse_fleet(raw, source="test"),
            {},
            build_strategy("fedavg", CNN, {}, seed=0),
            rundir,
            data,
            MemoryLink([LocalDevice(c.client_id, c.train, c.test) for c in clients]),
            EngineSettings(min_devices=4, wait_timeout_s=60, calibration_samples=len(data.train_x)),
            planner=fixed_levels({c.client_id: c.level for c in clients}),
        )

    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    first = engine(RunDir.create(tmp_path / "run", fleet_file, strategy.state_dict(), seed=0))
    assert first.run()
    history, records = first.admission.gate.history, first.admission.gate.records
    first.rundir.close()
    assert history.median("conv1.weight") is not None  # 8 accepted updates: the fleet's median is known
    assert sorted(records.state()) == ["pi-0", "pi-1", "pi-2", "pi-3"]  # agreeing rounds: every device has a record

    resumed = RunDir.open(tmp_path / "run", fleet_file)
    gate = engine(resumed).admission.gate
    assert gate.history.window() == history.window() and gate.records.state() == records.state()
    history.next_round()  # the last round's norms, saved as the open round's, join the peaks as the next opens
    assert gate.history.peaks() == history.peaks() and history.peak("conv1.weight") > 0  # the floor survives too
    resumed.close()


def test_a_norm_history_saved_for_a_round_that_never_committed_is_not_restored(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text("fleet: lab\n")
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", {"w": torch.zeros(2)}, seed=0)
    rundir.save_norm_history(1, [{"w": [0.5, 0.7]}])  # round 1 died before complete_round
    assert rundir.saved_norm_history() is None
    rundir.close()


@pytest.mark.slow
def test_a_round_with_update_noise_moves_the_global_weights_by_the_noise_and_nothing_else(tmp_path: Path) -> None:
    """Two runs of the same seeded FedAvg fleet: round 1 has no median yet (no noise), so the runs differ only by round
    2's noise, whose std per weight is z x the norm of round 1's median update / the 3 updates folded."""
    from coordinator.emulation.simulation import simulate

    clients = digit_clients(["d0", "d1", "d2"])
    data = load_dataset("digits", 8, 1)
    test = (data.test_x, data.test_y)

    def final(limits: dict[str, object], run_dir: Path) -> dict[str, torch.Tensor]:
        strategy = build_strategy("fedavg", CNN, {}, seed=0)
        simulate(strategy, clients, 2, TrainConfig(batch_size=32), test, data.train_x, limits=limits, run_dir=run_dir)
        return strategy.global_state()

    quiet = final({}, tmp_path / "quiet")
    noisy = final({"update_noise": 2.0}, tmp_path / "noisy")
    window = json.loads((tmp_path / "noisy" / "norm-history.json").read_text())["window"]
    medians = [sorted(norms)[1] for norms in window[0].values() if len(norms) == 3]
    expected = 2.0 * sum(m * m for m in medians) ** 0.5 / 3
    weights = [k for k in quiet if not is_norm_statistic(k)]
    added = torch.cat([(noisy[k] - quiet[k]).reshape(-1) for k in weights])
    assert float(added.std()) == pytest.approx(expected, rel=0.05)
