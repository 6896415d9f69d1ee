"""The planner's rules: biggest gamma that fits, clear exclusions, step-down after out-of-memory."""

from __future__ import annotations

import copy

import pytest
import torch

from coordinator.config.fleet import Fleet, load_fleet, parse_fleet
from coordinator.planning.planner import after_out_of_memory, level_cost, model_spec, plan_fleet
from coordinator.strategies import build_strategy
from device_agent.common.profile import DeviceProfile
from device_agent.models import build_model
from profiles.catalog import load_catalog
from tests.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "fleet.yaml"
CATALOG = load_catalog()
RATIOS = [1.0, 0.5, 0.25, 0.125]


def _fleet(devices: list[dict], **settings: object) -> Fleet:
    return parse_fleet({"fleet": "t", "transport": {"broker": {}}, "devices": devices, **settings}, CATALOG)


def _rank(ratio: float | None) -> float:
    return 0.0 if ratio is None else ratio


@pytest.mark.parametrize("profile", ["jetson-orin-nano-8gb", "raspberry-pi-5", "rtx-3050-laptop"])
def test_more_memory_never_gives_a_smaller_gamma(profile: str) -> None:
    sizes = [f"{mib} MiB" for mib in range(256, 5120, 64)]  # the agent process holds CIFAR-10 whole: ~0.6 GiB
    fleet = _fleet(
        [
            {"id": f"d{i}", "profile": profile, "overrides": {"memory": {"total": s, "reserved": 0}}}
            for i, s in enumerate(sizes)
        ],
        training={"batch_size": 128},
        round_deadline_s=1e6,
    )

    ratios = [_rank(row.ratio) for row in plan_fleet(fleet, CATALOG)]

    assert ratios == sorted(ratios)
    assert ratios[0] == 0.0 and ratios[-1] == 1.0, "the sweep should cross from excluded to full rank"
    assert len(set(ratios)) >= 3


def test_a_longer_deadline_never_gives_a_smaller_gamma() -> None:
    previous = 0.0
    for deadline in (15, 30, 60, 120, 240, 480, 960):
        fleet = _fleet(
            [{"id": "pi", "profile": "raspberry-pi-5"}],
            round_deadline_s=deadline,
            dataset={"samples_per_device": 2000},
        )
        ratio = _rank(plan_fleet(fleet, CATALOG)[0].ratio)
        assert ratio >= previous
        previous = ratio
    assert previous == 1.0


def test_planned_devices_fit_their_budget_and_deadline() -> None:
    fleet, catalog = load_fleet(EXAMPLE)

    for row in plan_fleet(fleet, catalog):
        if row.ratio is not None:
            assert row.est_memory_bytes <= row.memory_budget_bytes
            assert row.est_round_seconds <= row.deadline_seconds


def test_a_device_without_memory_for_any_ratio_is_excluded_with_the_numbers() -> None:
    fleet = _fleet([{"id": "tiny", "profile": "raspberry-pi-4", "overrides": {"memory": {"total": "0.75 GiB"}}}])

    [row] = plan_fleet(fleet, CATALOG)

    assert row.ratio is None
    assert row.reason.startswith("excluded: even gamma 1/8: needs ")
    assert "> budget" in row.reason and "safety 1.25" in row.reason
    assert row.est_memory_bytes > row.memory_budget_bytes


def test_a_device_too_slow_for_the_deadline_is_excluded_with_the_times() -> None:
    fleet = _fleet([{"id": "slow", "profile": "raspberry-pi-4"}], round_deadline_s=5)

    [row] = plan_fleet(fleet, CATALOG)

    assert row.ratio is None
    assert "round takes ~" in row.reason and "> deadline 5 s" in row.reason
    assert row.est_round_seconds > 5


def test_a_sub_second_deadline_is_refused_with_a_sub_second_time() -> None:
    fleet = _fleet(
        [{"id": "slow", "profile": "raspberry-pi-4"}],
        model={"arch": "cnn", "image_size": 8},
        dataset={"name": "digits", "samples_per_device": 64},
        round_deadline_s=0.001,
    )

    [row] = plan_fleet(fleet, CATALOG)

    assert row.est_round_seconds < 10  # the case that read "round takes ~0 s > deadline 0.001 s"
    assert f"round takes ~{row.est_round_seconds:.2g} s > deadline 0.001 s" in row.reason


def test_a_reported_device_waits_for_its_report_then_gets_planned() -> None:
    fleet = _fleet([{"id": "box", "profile": "reported"}], dataset={"samples_per_device": 500})
    assert plan_fleet(fleet, CATALOG)[0].reason == "waiting for the device's measured profile"

    report = _report(memory_total_bytes=16 * 2**30, memory_available_bytes=12 * 2**30, matmul_gflops=400)
    [row] = plan_fleet(fleet, CATALOG, reports={"box": report})

    assert row.ratio == 1.0
    assert row.profile == "reported (measured)"


def test_a_measured_profile_replaces_the_datasheet_and_changes_the_plan() -> None:
    fleet = _fleet(
        [{"id": "orin", "profile": "jetson-orin-nano-8gb"}], round_deadline_s=60, dataset={"samples_per_device": 5000}
    )
    static = plan_fleet(fleet, CATALOG)[0]

    throttled = _report(
        accelerator="cuda", memory_total_bytes=8 * 2**30, memory_available_bytes=6 * 2**30, matmul_gflops=150
    )
    measured = plan_fleet(fleet, CATALOG, reports={"orin": throttled})[0]

    assert static.ratio == 1.0
    assert _rank(measured.ratio) < static.ratio
    assert measured.est_round_seconds > static.est_round_seconds


def test_out_of_memory_steps_down_one_level_at_a_time() -> None:
    fleet = _fleet([{"id": "orin", "profile": "jetson-orin-nano-8gb"}, {"id": "other", "profile": "apple-m1"}])
    assert plan_fleet(fleet, CATALOG)[0].ratio == 1.0

    ceilings = after_out_of_memory({}, "orin", 1.0, RATIOS)
    first = plan_fleet(fleet, CATALOG, ceilings=ceilings)
    assert first[0].ratio == 0.5
    assert first[0].reason == "capped at 1/2 after running out of memory above it"
    assert first[1].ratio == 1.0, "other devices are not affected"

    ceilings = after_out_of_memory(ceilings, "orin", 0.5, RATIOS)
    assert plan_fleet(fleet, CATALOG, ceilings=ceilings)[0].ratio == 0.25

    for ratio in (0.25, 0.125):
        ceilings = after_out_of_memory(ceilings, "orin", ratio, RATIOS)
    [row, _] = plan_fleet(fleet, CATALOG, ceilings=ceilings)
    assert row.ratio is None
    assert row.reason == "ran out of memory at the smallest ratio 1/8"


def test_a_late_out_of_memory_report_never_raises_the_ceiling() -> None:
    ceilings = after_out_of_memory({}, "orin", 0.25, RATIOS)

    assert after_out_of_memory(ceilings, "orin", 1.0, RATIOS)["orin"] == 0.125


def test_max_ratio_override_caps_a_device() -> None:
    fleet = _fleet([{"id": "rtx", "profile": "rtx-4060-laptop", "overrides": {"max_ratio": "1/4"}}])

    [row] = plan_fleet(fleet, CATALOG)

    assert row.ratio == 0.25
    assert "max_ratio" in row.reason


def test_the_example_fleet_uses_every_rank_level_and_excludes_a_device_for_a_reason() -> None:
    fleet, catalog = load_fleet(EXAMPLE)
    profiles = {d.profile for d in fleet.devices}

    rows = plan_fleet(fleet, catalog)

    assert {"jetson-nano", "raspberry-pi-5", "apple-m1"} <= profiles
    assert any(p.startswith("jetson-orin-nano") for p in profiles) and any(p.startswith("rtx-") for p in profiles)
    assert {row.ratio for row in rows} - {None} == set(RATIOS)
    excluded = [row for row in rows if row.ratio is None and row.reason.startswith("excluded")]
    assert excluded, "at least one device is excluded because it cannot fit, not merely waiting"
    assert all(("needs" in row.reason) or ("deadline" in row.reason) for row in excluded)


def test_a_fixed_width_strategy_plans_every_device_at_that_width() -> None:
    fleet = _fleet(
        [{"id": "rtx", "profile": "rtx-4060-laptop"}, {"id": "pi", "profile": "raspberry-pi-4"}],
        strategy={"name": "fedavg_small", "params": {"level": 0.25}},
        round_deadline_s=1e6,
    )
    with torch.device("meta"):
        small = build_model("resnet18", 10, 3, width=0.25)

    rows = plan_fleet(fleet, CATALOG)

    assert [row.model for row in rows] == ["width 0.25 (fixed)"] * 2
    assert {row.trainable_params for row in rows} == {sum(p.numel() for p in small.parameters())}
    assert [row.ratio for row in rows] == [1.0, 1.0], "every level costs the same, so the largest is kept"


def test_a_strategy_without_levels_names_the_full_model_when_it_excludes_a_device() -> None:
    fleet = _fleet(
        [{"id": "tiny", "profile": "raspberry-pi-4", "overrides": {"memory": {"total": "0.75 GiB"}}}],
        strategy={"name": "factorized_fl"},
    )

    [row] = plan_fleet(fleet, CATALOG)

    assert row.ratio is None and row.model == "full model"
    assert row.reason.startswith("excluded: full model: needs ")


def _report(**changes: object) -> DeviceProfile:
    flat = {
        "hostname": "box",
        "platform": "Linux",
        "machine": "x86_64",
        "python": "3.11",
        "torch": "2.13.0",
        "cpu_count": 8,
        "accelerator": "cpu",
        "accelerator_name": None,
        "accelerator_memory_bytes": None,
    }
    data = {**flat, **copy.deepcopy(changes)}
    if data["accelerator"] == "cuda":
        data["accelerator_memory_bytes"] = data["memory_total_bytes"]
    return DeviceProfile.model_validate(data)


@pytest.mark.parametrize("strategy", ["fedhm", "heterofl"])
def test_under_secure_aggregation_every_level_uploads_the_full_model_masked_and_the_protocol(strategy: str) -> None:
    settings = {
        "strategy": {"name": strategy},
        "ratios": [1, 0.5, 0.25],
        "limits": {"update_bound_factor": None, "peer_min_cosine": None, "peer_hard_floor": None},
        "model": {"arch": "cnn", "num_classes": 10},
    }
    devices = [{"id": f"d{i}", "profile": "raspberry-pi-5"} for i in range(10)]
    plain = _fleet(devices, **settings)
    secure = _fleet(devices, **settings, secure_aggregation={"threshold": 5, "neighbours": 8})
    full = level_cost(plain, 1.0).upload_bytes  # float32: a masked word is 4 bytes as well (a 20-bit ring here)

    for level in (1.0, 0.5, 0.25):
        assert level_cost(plain, level).upload_bytes <= full
        assert level_cost(secure, level).upload_bytes == full + 640 * 8 + 600  # keys, shares, answers: 8 neighbours
    # FedHM at gamma 1/4 sends 3.8x its factors' bytes; a HeteroFL width-1/4 device 15x its slice.
    assert level_cost(secure, 0.25).upload_bytes / level_cost(plain, 0.25).upload_bytes > 3.5


@pytest.mark.parametrize("strategy", ["hetlora", "fedlora"])
def test_under_secure_aggregation_lora_devices_upload_the_largest_rank_or_the_dense_products(strategy: str) -> None:
    settings = {
        "strategy": {"name": strategy, "params": {"weighting": "samples"}},
        "ratios": [1, 0.5, 0.25],
        "limits": {"update_bound_factor": None, "peer_min_cosine": None, "peer_hard_floor": None},
        "model": {"arch": "vit_tiny", "num_classes": 10},
    }
    devices = [{"id": f"d{i}", "profile": "raspberry-pi-5"} for i in range(10)]
    plain = _fleet(devices, **settings)
    secure = _fleet(devices, **settings, secure_aggregation={"threshold": 5, "neighbours": 8})
    protocol = 640 * 8 + 600
    strategy_ = build_strategy(strategy, model_spec(secure), settings["strategy"]["params"])
    head = sum(strategy_.state[k].numel() for k in strategy_.head_keys)
    padded = level_cost(plain, 1.0).upload_bytes  # HetLoRA pads every rank to max_rank's factors
    dense = 4 * (head + sum(o * i for o, i in strategy_.layers.values()))  # fedlora masks B A of every layer

    for level in (1.0, 0.5, 0.25):
        assert level_cost(secure, level).upload_bytes == (padded if strategy == "hetlora" else dense) + protocol
