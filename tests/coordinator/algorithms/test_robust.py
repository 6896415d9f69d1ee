"""Update norms in the full-rank space, clipping that keeps a factor pair's shapes, the direction reference,
the direction sketches of the peer check, and the buffered rules."""

import statistics

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from coordinator.algorithms.robust import (
    DirectionReference,
    NormHistory,
    Outlier,
    PeerHistory,
    apply_steps,
    clip_layer,
    coordinate_median,
    cosine,
    dense_updates,
    iterated_outliers,
    layer_norms,
    layers_of,
    multi_krum,
    noised,
    peer_cosines,
    peer_cut,
    round_deviations,
    sketch,
    trimmed_mean,
)
from device_agent.layers.factorized import factors_to_matrices, matrices_to_factors, weight_to_matrix


def update_norms(upload: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per layer, the norm of upload minus sent in the full-rank space, as the upload gate measures it."""
    return layer_norms(dense_updates(upload, sent))


def factor_pair(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "fc.reduce": scale * torch.randn(4, 16, generator=generator),
        "fc.expand": scale * torch.randn(10, 4, generator=generator),
        "fc.bias": scale * torch.randn(10, generator=generator),
    }


def test_a_factor_pair_is_one_layer_measured_as_its_product() -> None:
    sent, upload = factor_pair(0), factor_pair(1)
    assert layers_of(upload) == {"fc": ("fc.reduce", "fc.expand"), "fc.bias": ("fc.bias",)}
    a, b = factors_to_matrices(upload["fc.reduce"], upload["fc.expand"])
    a0, b0 = factors_to_matrices(sent["fc.reduce"], sent["fc.expand"])
    norms = update_norms(upload, sent)
    assert norms["fc"] == pytest.approx(float((a @ b - a0 @ b0).norm()), rel=1e-5)
    assert norms["fc.bias"] == pytest.approx(float((upload["fc.bias"] - sent["fc.bias"]).norm()), rel=1e-5)


def test_minus_nine_and_a_half_times_both_factors_is_a_large_dense_update() -> None:
    sent = factor_pair(0)
    attack = {k: -9.5 * v for k, v in sent.items()}
    a0, b0 = factors_to_matrices(sent["fc.reduce"], sent["fc.expand"])
    # The factors' signs cancel in A @ B: the dense weight becomes 90.25 x what was sent, an update of 89.25 x.
    assert update_norms(attack, sent)["fc"] == pytest.approx(89.25 * float((a0 @ b0).norm()), rel=1e-4)


def test_clipping_brings_each_layer_to_its_bound_and_keeps_the_shapes() -> None:
    sent, upload = factor_pair(0), factor_pair(1, scale=5.0)
    layers = layers_of(upload)
    steps = {name: clip_layer(upload, sent, keys, bound=0.5) for name, keys in layers.items()}
    clipped = apply_steps(upload, sent, steps)
    assert {k: v.shape for k, v in clipped.items()} == {k: v.shape for k, v in upload.items()}
    for norm in update_norms(clipped, sent).values():
        assert 0.49 < norm <= 0.5 + 1e-6
    assert clip_layer(upload, sent, layers["fc.bias"], bound=1e9) == 1.0  # within the bound: untouched


def test_the_history_median_needs_enough_updates_and_forgets_old_rounds() -> None:
    history = NormHistory(rounds=2, min_updates=3)
    history.add({"w": 1.0}, "a")
    history.add({"w": 2.0}, "b")
    history.add({"w": 3.0}, "c")
    assert history.median("w") is None  # the open round's norms count only once it closes
    history.next_round()
    assert history.median("w") == 2.0
    history.add({"w": 100.0}, "a")
    history.add({"w": 200.0}, "x")
    history.forget("x")  # refused at the close
    history.next_round()
    assert history.median("w") == 2.5  # one outlier barely moves the median; the refused one is not in it
    history.add({"w": 5.0}, "a")
    history.next_round()
    assert history.median("w") is None  # the first round fell out of the window: only 2 norms left


def test_buffered_rules_ignore_a_minority_far_away() -> None:
    honest = [torch.tensor([1.0, 2.0]) + 0.01 * i for i in range(7)]
    bad = [torch.tensor([1e3, -1e3])] * 2
    updates = honest + bad
    assert torch.allclose(coordinate_median(updates), torch.tensor([1.04, 2.02]), atol=1e-4)  # the bad sit at both ends
    assert torch.allclose(trimmed_mean(updates, 0.25), torch.tensor([1.04, 2.02]), atol=1e-4)
    chosen = multi_krum(updates, byzantine=2, keep=5)
    assert len(chosen) == 5 and not set(chosen) & {7, 8}
    with pytest.raises(ValueError, match="Krum needs more than 2f"):
        multi_krum(updates[:5], byzantine=2, keep=1)
    with pytest.raises(ValueError, match="beta must be in"):
        trimmed_mean(updates, 0.5)


def test_the_dense_update_of_a_factor_pair_is_the_change_of_its_product() -> None:
    sent, upload = factor_pair(0), factor_pair(1)
    a, b = factors_to_matrices(upload["fc.reduce"], upload["fc.expand"])
    a0, b0 = factors_to_matrices(sent["fc.reduce"], sent["fc.expand"])
    updates = dense_updates(upload, sent)
    assert set(updates) == {"fc", "fc.bias"}
    assert torch.allclose(updates["fc"], (a @ b - a0 @ b0).to(torch.float64), atol=1e-5)
    assert "fc.bias" not in dense_updates(upload, {k: v for k, v in sent.items() if k != "fc.bias"})  # not sent


def test_cosine_is_over_the_shared_layers_as_one_vector() -> None:
    update = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 1.0]), "own": torch.ones(3)}
    assert cosine(update, {"w": torch.tensor([2.0, 0.0]), "b": torch.tensor([0.0, 2.0])}) == pytest.approx(1.0)
    assert cosine(update, {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, -1.0])}) == pytest.approx(0.0)
    assert cosine(update, {"w": torch.tensor([-1.0, 0.0])}) == pytest.approx(-1.0)  # "b", "own" not shared
    assert cosine(update, {"w": torch.zeros(3)}) is None  # another shape: nothing shared
    assert cosine(update, {"w": torch.zeros(2)}) is None  # no direction to compare with


def test_the_reference_is_last_rounds_unit_updates_summed_so_one_large_reversed_update_cannot_turn_it() -> None:
    reference = DirectionReference()
    honest = {"w": torch.tensor([1.0, 0.1], dtype=torch.float64)}
    assert reference.cosine(honest) is None  # warm-up: the first round has no reference
    for scale in (1.0, 0.5, 2.0):
        reference.add({"w": scale * honest["w"]})
    reference.add({"w": -1000.0 * honest["w"]})  # in the warm-up round nothing bounds its direction yet
    assert reference.cosine(honest) is None  # the sum is this round's, not yet the reference
    reference.next_round()
    assert reference.cosine(honest) == pytest.approx(1.0)  # three votes for, one against
    assert reference.cosine({"w": -honest["w"]}) == pytest.approx(-1.0)
    reference.next_round()  # a round that accepted nothing keeps the reference it had
    assert reference.cosine(honest) == pytest.approx(1.0)
    reference.add({"w": torch.tensor([0.0, 1.0])})
    reference.next_round()
    assert reference.cosine({"w": torch.tensor([0.0, 3.0])}) == pytest.approx(1.0)  # only last round counts


def test_sketch_dot_products_estimate_the_cosines_of_the_full_updates() -> None:
    generator = torch.Generator().manual_seed(3)
    shared = {"conv.weight": torch.randn(64, 32, 3, 3, generator=generator), "fc.bias": torch.randn(10)}
    for mix in (0.0, 0.3, 0.7, 1.0):
        other = {k: mix * v + (1 - mix) * torch.randn(v.shape, generator=generator) for k, v in shared.items()}
        estimate = float(sketch(shared) @ sketch(other))
        assert estimate == pytest.approx(cosine(shared, other), abs=0.05)
    assert float(sketch(shared).norm()) == pytest.approx(1.0, abs=0.05)  # a unit vote, whatever its size
    assert float(sketch({k: 100 * v for k, v in shared.items()}) @ sketch(shared)) == pytest.approx(1.0, abs=0.05)


def test_hash_tables_are_drawn_once_within_their_budget_and_hash_alike_past_it() -> None:
    from coordinator.algorithms.robust import _HashTables

    tables = _HashTables(budget=16 * 100)
    small = tables.get("small:(100,)", 100, 64)
    assert tables.get("small:(100,)", 100, 64) is small  # kept: the budget holds its 100 elements
    big = tables.get("big:(1000,)", 1000, 64)
    again = tables.get("big:(1000,)", 1000, 64)
    assert again is not big  # over the budget: drawn again, the same way
    assert torch.equal(again[0], big[0]) and torch.equal(again[1], big[1])


def test_layers_of_other_names_or_shapes_do_not_meet_in_a_sketch() -> None:
    weight = torch.randn(32, 16)
    assert abs(float(sketch({"a": weight}) @ sketch({"b": weight}))) < 0.1
    assert abs(float(sketch({"a": weight}) @ sketch({"a": weight.reshape(16, 32)}))) < 0.1
    assert not sketch({"a": torch.zeros(5)}).any() and not sketch({"a": torch.full((5,), float("inf"))}).any()


def as_uploaded(direction: torch.Tensor, rank: int | None, seed: int) -> dict[str, torch.Tensor]:
    """One device's update of a 3 x 3 convolution as the gate sketches it: ``conv.weight`` at full rank, else
    the :func:`dense_updates` of a rank-``rank`` factor pair (``conv``, its A @ B matrix), plus noise."""
    generator = torch.Generator().manual_seed(seed)
    update = direction + torch.randn(direction.shape, generator=generator)
    if rank is None:
        return {"conv.weight": update, "conv.bias": direction[:, 0, 0, 0]}
    u, s, v = torch.linalg.svd(weight_to_matrix(update))
    reduce, expand = matrices_to_factors(u[:, :rank] * s[:rank], v[:rank], update.shape)
    upload = {"conv.reduce": reduce, "conv.expand": expand}
    sent = {k: torch.zeros_like(t) for k, t in upload.items()}  # sent 0: the upload's A @ B is the update
    return dense_updates(upload, sent) | {"conv.bias": direction[:, 0, 0, 0]}


def test_a_full_rank_weight_and_a_factor_pair_of_the_same_layer_meet_in_the_sketch() -> None:
    direction = torch.randn(32, 16, 3, 3, generator=torch.Generator().manual_seed(11))
    full, low = as_uploaded(2 * direction, None, seed=1), as_uploaded(2 * direction, 12, seed=2)
    assert set(low) == {"conv", "conv.bias"} and low["conv"].shape == (96, 48)
    true = cosine({"conv": weight_to_matrix(full["conv.weight"]), "conv.bias": full["conv.bias"]}, low)
    assert true is not None and true > 0.5
    assert float(sketch(full) @ sketch(low)) == pytest.approx(true, abs=0.05)  # not just conv.bias's share


def test_the_direction_reference_adds_full_rank_and_low_rank_updates_of_a_layer_together() -> None:
    direction = torch.randn(32, 16, 3, 3, generator=torch.Generator().manual_seed(13))
    reference = DirectionReference()
    reference.add(as_uploaded(2 * direction, None, seed=1))
    reference.next_round()
    low = as_uploaded(2 * direction, 12, seed=2)
    assert set(reference.reference) == {"conv", "conv.bias"}  # one sum per layer, whatever rank voted
    assert reference.cosine(low) == pytest.approx(float(sketch(low) @ sketch(reference.reference)), abs=0.05)
    assert reference.cosine(low) > 0.5 and reference.cosine({k: -v for k, v in low.items()}) < -0.5


def test_a_mixed_rank_fleet_in_its_upload_forms_agrees_across_levels() -> None:
    direction = torch.randn(32, 16, 3, 3, generator=torch.Generator().manual_seed(12))
    ranks = [None, None, None, 24, 24, 24, 12, 12, 12, 12]  # FedHM at 1, 1/2 and 1/4 of a 48-rank layer
    sketches = {f"h{i}": sketch(as_uploaded(0.5 * direction, r, seed=i)) for i, r in enumerate(ranks)}
    honest = peer_cosines(sketches)
    assert min(honest.values()) > 0.2  # full-rank devices compared with the low-rank ones on the conv layer too
    sketches["h0"] = -sketches["h0"]  # a full-rank device reversed
    assert [r.device for r in iterated_outliers(sketches, -0.1, 3.0)] == ["h0"]


def test_peer_cosines_leave_each_update_out_of_its_own_reference() -> None:
    generator = torch.Generator().manual_seed(4)
    fleet = torch.randn(5000, generator=generator)
    uploads = {f"h{i}": {"w": fleet + torch.randn(5000, generator=generator)} for i in range(5)}
    uploads["flip"] = {"w": -uploads["h0"]["w"]}
    cosines = peer_cosines({d: sketch(u) for d, u in uploads.items()})
    for device, upload in uploads.items():
        votes = [v["w"] for d, v in uploads.items() if d != device and abs(cosine(v, upload) or 0) < 0.95]
        others = {"w": sum(v / v.norm() for v in votes)}  # an exact reversal is no vote on its original
        assert cosines[device] == pytest.approx(cosine(upload, others), abs=0.05)
    assert cosines["flip"] < -0.5 < 0.3 < min(c for d, c in cosines.items() if d != "flip")
    assert peer_cosines({"alone": sketch(uploads["h1"])}) == {}  # no peers: no cosine


def test_outliers_are_the_worst_below_the_cut_and_always_fewer_than_half() -> None:
    generator = torch.Generator().manual_seed(5)
    fleet = torch.randn(4000, generator=generator)
    honest = {f"h{i}": sketch({"w": fleet + torch.randn(4000, generator=generator)}) for i in range(3)}
    flips = {f"f{i}": sketch({"w": -fleet + torch.randn(4000, generator=generator)}) for i in range(3)}
    removed = iterated_outliers(honest | dict(list(flips.items())[:2]), -0.1, 3.0)
    assert sorted(r.device for r in removed) == ["f0", "f1"]
    assert len(iterated_outliers(honest | flips, -0.1, 3.0)) <= 2  # 3 of 6 are never half the round


def mixed_rank_fleet(seed: int) -> dict[str, torch.Tensor]:
    """Ten honest updates of one 64 x 32 layer as FedHM folds them: full rank, 1/2 and 1/4 (A @ B)."""
    generator = torch.Generator().manual_seed(seed)
    fleet = torch.randn(64, 32, generator=generator)
    updates = {}
    for i, level in enumerate([1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]):
        u, s, v = torch.linalg.svd(0.3 * fleet + torch.randn(64, 32, generator=generator))
        rank = int(32 * level)
        updates[f"h{i}"] = (u[:, :rank] * s[:rank]) @ v[:rank]
    return updates


def test_two_flips_on_a_mixed_rank_fleet_are_both_refused_once_the_first_is_out() -> None:
    updates = mixed_rank_fleet(1)
    sketches = {d: sketch({"w": u}) for d, u in updates.items()}
    assert iterated_outliers(sketches, -0.1, 3.0) == []  # honest noise at mixed ranks: nobody refused
    sketches["h0"], sketches["h6"] = -sketches["h0"], -sketches["h6"]  # a full-rank and a 1/4 device reversed
    once = peer_cosines(sketches)
    assert once["h6"] > -0.1  # one pass: the other flipper's vote lifts the 1/4 flipper over the floor
    removed = iterated_outliers(sketches, -0.1, 3.0)
    assert sorted(r.device for r in removed) == ["h0", "h6"]


def test_colluders_sending_one_update_count_as_one_vote() -> None:
    updates = mixed_rank_fleet(1)
    sketches = {d: sketch({"w": u}) for d, u in updates.items()}
    mean = sum(updates.values())
    noise = torch.randn(64, 32, generator=torch.Generator().manual_seed(9))
    target = sketch({"w": -8 * mean / mean.norm() + noise})  # a reversed update, noisy enough to look honest
    sketches["c0"], sketches["c1"] = target, target.clone()
    voting = peer_cosines(sketches, duplicate=2.0)  # the check before: each colluder in the other's reference
    assert voting["c0"] > 0  # the other colluder's vote carries it over the floor
    assert peer_cosines(sketches)["c0"] < -0.1
    assert sorted(r.device for r in iterated_outliers(sketches, -0.1, 3.0)) == ["c0", "c1"]


def unit_toward(direction: torch.Tensor, agreement: float, generator: torch.Generator) -> torch.Tensor:
    """A unit update with cosine ``agreement`` to the unit ``direction``, the rest its own noise."""
    noise = torch.randn(direction.numel(), generator=generator)
    noise -= (noise @ direction) * direction
    return agreement * direction + (1 - agreement**2) ** 0.5 * noise / noise.norm()


def wide_fleet() -> dict[str, torch.Tensor]:
    """Sketches of eight honest updates whose agreement with the fleet's direction spreads wide (0.2 to 0.9)."""
    generator = torch.Generator().manual_seed(1)
    fleet = torch.randn(20000, generator=generator)
    fleet /= fleet.norm()
    agreements = [0.9, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2]
    return {f"h{i}": sketch({"w": unit_toward(fleet, a, generator)}) for i, a in enumerate(agreements)}


def test_under_the_hard_floor_an_update_is_refused_whatever_the_rounds_spread() -> None:
    sketches = wide_fleet()
    assert iterated_outliers(sketches, -0.1, 3.0, hard_floor=-0.25) == []  # honest, spread wide: all accepted
    sketches["f3"], sketches["f4"] = -sketches.pop("h3"), -sketches.pop("h4")  # two devices reverse their own
    assert iterated_outliers(sketches, -0.1, 3.0) == []  # the relative cut alone fell below them
    removed = iterated_outliers(sketches, -0.1, 3.0, hard_floor=-0.25)
    assert sorted(r.device for r in removed) == ["f3", "f4"] and all(r.cosine < r.cut == -0.25 for r in removed)


def test_copies_of_an_honest_update_reversed_cannot_vote_it_out() -> None:
    sketches = wide_fleet()
    sketches["a0"], sketches["a1"] = -sketches["h7"], -1.01 * sketches["h7"]
    assert peer_cosines(sketches)["h7"] > 0  # the reversed copies are no vote on the update they copy
    assert "h7" not in [r.device for r in iterated_outliers(sketches, -0.1, 3.0, hard_floor=-0.25)]


def test_the_cut_follows_the_round_so_a_converged_rounds_noise_is_not_refused() -> None:
    agreeing = {"a": 0.62, "b": 0.58, "c": 0.55, "d": 0.66, "flip": -0.6}
    assert peer_cut(agreeing, -0.1, 3.0) == -0.1  # early rounds: the floor decides, the reversed update is out
    converged = {"a": -0.15, "b": -0.05, "c": 0.0, "d": 0.05, "e": 0.1, "f": 0.12, "g": 0.03, "h": 0.08}
    cut = peer_cut(converged, -0.1, 3.0)
    assert cut < min(converged.values())  # honest noise around 0: nobody refused
    assert peer_cut(converged, -0.1, 0.0) == -0.1  # spread 0: the floor alone, as before
    wide = {"a": 0.7, "b": 0.5, "c": 0.45, "d": 0.3, "e": 0.1, "f": -0.3}
    assert peer_cut(wide, -0.1, 3.0) < -0.3 and peer_cut(wide, -0.1, 3.0, -0.25) == -0.25  # never under the floor


def test_a_round_without_agreement_is_judged_by_the_hard_floor_alone() -> None:
    # a converged non-IID round like the soak's round 57: honest cosines around 0, one at -0.196 (it was refused)
    converged = {"a": -0.196, "b": -0.05, "c": 0.0, "d": 0.01, "e": 0.02, "f": 0.03, "g": 0.05, "h": 0.08}
    assert peer_cut(converged, -0.1, 3.0) == -0.1  # the relative rule refused the honest tail
    assert peer_cut(converged, -0.1, 0.0, -0.35, agreement=0.1) == -0.35  # no direction to judge: the hard floor
    assert peer_cut(converged, -0.1, 0.0, agreement=0.1) == float("-inf")  # without one, nobody refused
    agreeing = {"a": 0.62, "b": 0.58, "c": 0.55, "d": 0.66, "e": 0.3, "flip": -0.3}
    assert peer_cut(agreeing, -0.1, 0.0, -0.35, agreement=0.1) == -0.1  # agreeing: the floor judges


def test_in_an_agreeing_round_the_floor_refuses_reversals_however_wide_the_spread() -> None:
    sketches = wide_fleet()
    sketches["f3"], sketches["f4"] = -sketches.pop("h3"), -sketches.pop("h4")  # two devices reverse their own
    relative = iterated_outliers(sketches, -0.1, 3.0, hard_floor=-0.35, agreement=0.1)
    assert [r.device for r in relative] == ["f3"]  # the spread sank the cut: only the hard floor held one
    removed = iterated_outliers(sketches, -0.1, 0.0, hard_floor=-0.35, agreement=0.1)
    assert sorted(r.device for r in removed) == ["f3", "f4"] and all(r.cut == -0.1 for r in removed)


@given(
    rounds=st.lists(
        st.lists(st.floats(0, 1e6, allow_nan=False), max_size=12),
        min_size=1,
        max_size=6,
    ),
    window=st.integers(1, 3),
)
@example(rounds=[[0.0], [1.0], [0.0]], window=2)  # restored one round at a time, [1.0] alone once raised the peak
def test_the_history_median_is_the_median_of_the_norms_in_its_window(rounds, window) -> None:
    """The median is the window's; the peak the highest that median has been, also after the window slid past it
    and after a restore."""
    history = NormHistory(rounds=window, min_updates=1)
    closed: list[list[float]] = []
    medians = [0.0]
    for norms in rounds:
        for index, norm in enumerate(norms):
            history.add({"w": norm}, f"d{index}")
        history.next_round()
        if norms:  # a round that accepted nothing leaves the window as it was
            closed.append(norms)
        kept = [norm for round_ in closed[-window:] for norm in round_]
        assert history.median("w") == (statistics.median(kept) if kept else None)
        medians.append(statistics.median(kept) if kept else 0.0)
        assert history.peak("w") == max(medians)
    saved = history.window()
    restored = NormHistory(rounds=window, min_updates=1)
    restored.restore(saved, history.peaks())
    assert restored.window() == saved and restored.median("w") == history.median("w")
    assert restored.peaks() == history.peaks()


def test_noised_adds_gaussian_noise_of_the_given_std_to_the_named_weights_only() -> None:
    generator = torch.Generator().manual_seed(0)
    state = {"w": torch.ones(200, 100), "bn.running_mean": torch.zeros(100)}

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return std * torch.randn(shape, generator=generator, dtype=torch.float64)

    out = noised(state, ["w"], 0.05, normal)
    added = out["w"] - state["w"]
    assert out["w"].dtype == torch.float32 and torch.equal(out["bn.running_mean"], state["bn.running_mean"])
    assert float(added.mean()) == pytest.approx(0, abs=2e-3) and float(added.std()) == pytest.approx(0.05, rel=0.03)


def test_the_median_update_norm_is_the_norm_of_every_layers_median() -> None:
    history = NormHistory(rounds=3, min_updates=3)
    assert history.median_update_norm() is None
    for device, (w, b) in enumerate([(3.0, 4.0), (30.0, 40.0), (3.0, 4.0)]):
        history.add({"w": w, "b": b}, f"d{device}")
    history.next_round()
    assert history.median_update_norm() == pytest.approx(5.0)


def test_the_outlier_cut_refuses_an_update_far_below_a_round_that_agrees_even_above_the_floor() -> None:
    """A backdoor device on iid digits: its cosine 0.10 with the rest of a round whose honest updates read 0.53-0.66."""
    honest = {f"h{i}": 0.66 - 0.015 * i for i in range(9)}
    round_ = {**honest, "bad": 0.10}
    outlier = Outlier(deviations=6, gap=0.3)
    assert peer_cut(round_, -0.1, 0.0, -0.35, 0.1) == -0.1  # the floor alone lets it through
    cut = peer_cut(round_, -0.1, 0.0, -0.35, 0.1, outlier)
    assert 0.10 < cut < min(honest.values())
    # A round whose honest updates spread wide (label skew) moves the cut down with them: no honest update refused.
    spread = {f"h{i}": 0.70 - 0.08 * i for i in range(9)}
    assert peer_cut(spread, -0.1, 0.0, -0.35, 0.1, outlier) < min(spread.values())
    # A round that does not agree keeps only the hard floor.
    assert peer_cut({f"h{i}": 0.05 - 0.02 * i for i in range(9)}, -0.1, 0.0, -0.35, 0.1, outlier) == -0.35


def skewed_round(generator: torch.Generator, low: float) -> dict[str, torch.Tensor]:
    """Nine sketches of a round that agrees (a shared direction, noise of their own) and ``bad``, ``low`` less of the
    shared direction: a device that pulls a little away from the round, as a backdoor's or an unusual shard's."""
    fleet = torch.randn(4000, generator=generator)
    round_ = {f"h{i}": sketch({"w": fleet + 1.2 * torch.randn(4000, generator=generator)}) for i in range(9)}
    round_["bad"] = sketch({"w": (1 - low) * fleet + 1.2 * torch.randn(4000, generator=generator)})
    return round_


def test_a_device_low_in_every_round_is_refused_by_its_record_one_low_round_is_not() -> None:
    """A backdoor device's update reads a little low in every round, an unusual honest one's in one round: no single
    round tells them apart (no cut refuses either), the record does."""
    generator = torch.Generator().manual_seed(21)
    records = PeerHistory(rounds=10, prior=1.0)
    refused: list[list[str]] = []
    for _ in range(6):
        round_ = skewed_round(generator, low=0.6)
        assert iterated_outliers(round_, -0.1, 0.0, hard_floor=-0.35, agreement=0.1) == []  # no cut sees it
        removed = iterated_outliers(
            round_, -0.1, 0.0, hard_floor=-0.35, agreement=0.1, history=records, history_gap=0.2
        )
        refused.append([r.device for r in removed])
        records.record(round_deviations(round_, refused[-1], agreement=0.1))
    assert refused[0] == [] and all(r == ["bad"] for r in refused[2:])  # the first round alone is not enough
    assert all(r.score is not None and r.score < -0.2 for r in removed)  # refused by its record, not by a cut
    assert max(records.score(f"h{i}") for i in range(9)) < 0.1 and records.score("bad") < -0.2


def test_in_a_round_that_does_not_agree_a_bad_record_refuses_only_an_update_under_the_rounds_median() -> None:
    """A converged round on label-skewed data has no direction (median cosine under the agreement): its deviations
    join no record, and a device's past refuses its update only if this one reads low too, so an honest device
    with a poor record is not held out while its updates read as usual (and the backoff does not compound it)."""
    generator = torch.Generator().manual_seed(24)
    records = PeerHistory(rounds=10, prior=1.0)
    for _ in range(4):
        round_ = skewed_round(generator, low=0.6)
        records.record(round_deviations(round_, ["bad"], agreement=0.2))
    assert records.score("bad") < -0.2  # a bad record: refused in a round that agrees

    def converged(pull: float) -> dict[str, torch.Tensor]:
        honest = [torch.randn(4000, generator=generator) for _ in range(9)]
        others = torch.stack(honest).sum(0)
        bad = pull * others / others.norm() + torch.randn(4000, generator=generator) / 64
        return {f"h{i}": sketch({"w": h}) for i, h in enumerate(honest)} | {"bad": sketch({"w": bad})}

    for pull, refused in ((0.5, []), (-0.3, ["bad"])):
        round_ = converged(pull)
        cosines = peer_cosines(round_)
        assert statistics.median(cosines.values()) < 0.2 and cosines["bad"] > -0.35  # no cut judges it
        removed = iterated_outliers(
            round_, -0.2, 0.0, hard_floor=-0.35, agreement=0.2, history=records, history_gap=0.2
        )
        assert [r.device for r in removed] == refused  # above the median: passes; under it: its record refuses it
        assert round_deviations(round_, refused, agreement=0.2) == {}  # the record learns nothing from it


def test_a_record_counts_only_rounds_that_agree_and_its_last_rounds() -> None:
    generator = torch.Generator().manual_seed(22)
    noise = {f"h{i}": sketch({"w": torch.randn(4000, generator=generator)}) for i in range(10)}
    assert round_deviations(noise, [], agreement=0.1) == {}  # no direction: nobody's record moves
    records = PeerHistory(rounds=3, prior=1.0)
    for value in (-0.9, -0.1, -0.1, -0.1):
        records.record({"d": value})
    assert records.score("d") == pytest.approx(-0.3 / 4)  # the oldest left the window; one prior round of 0
    assert records.score("d", -0.5) == pytest.approx(-0.8 / 5)  # this round counted when it agrees
    assert records.score("new") == 0.0 and PeerHistory(3, 0.0).score("new") == 0.0
    restored = PeerHistory(rounds=3, prior=1.0)
    restored.restore(records.state())
    assert restored.score("d") == records.score("d")


def test_a_removed_update_is_measured_against_the_kept_ones() -> None:
    generator = torch.Generator().manual_seed(23)
    round_ = skewed_round(generator, low=0.0)
    round_["flip"] = -round_["h0"]
    deviations = round_deviations(round_, ["flip"], agreement=0.1)
    assert set(deviations) == set(round_) and deviations["flip"] < -0.5
    assert statistics.median(v for d, v in deviations.items() if d != "flip") == pytest.approx(0.0)
