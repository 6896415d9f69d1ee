import pytest

from benchmarks import stats


def test_the_interval_is_students_t_and_one_seed_separates_nothing() -> None:
    mean, _, high = stats.paired_interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert (mean, high - mean) == (2.0, pytest.approx(4.303 * 1.0 / 3**0.5, abs=1e-3))  # t(0.975, 2) = 4.303
    assert stats.verdict(*stats.paired_interval([0.9], [0.1])[1:]) == "TIE"
    assert stats.interval_of(*stats.paired_interval([0.9], [0.1])[1:]) is None  # JSON has no Infinity
    assert stats.interval_of(-0.5, 0.25) == [-0.5, 0.25]


def test_pairing_seeds_separates_what_their_spread_hides() -> None:
    theirs = [0.70, 0.60, 0.80, 0.65, 0.75]  # seeds spread by 0.2
    ours = [a + d for a, d in zip(theirs, (0.012, 0.008, 0.011, 0.009, 0.010), strict=True)]
    mean, low, high = stats.paired_interval(ours, theirs)
    assert mean == pytest.approx(0.01) and stats.verdict(low, high) == "PASS"
    assert stats.verdict(*stats.paired_interval(theirs, ours)[1:]) == "FAIL"
    noisy = [a + d for a, d in zip(theirs, (0.05, -0.04, 0.03, -0.02, 0.0), strict=True)]
    assert stats.verdict(*stats.paired_interval(noisy, theirs)[1:]) == "TIE"


def test_a_score_is_the_mean_of_the_last_rounds_it_has() -> None:
    assert stats.last_rounds_mean([0.1, 0.2, 0.5, 0.6, 0.7]) == pytest.approx(0.6)
    assert stats.last_rounds_mean([0.4, None]) == 0.4  # a round without a figure is left out
    assert stats.last_rounds_mean([None]) is None


def test_a_summary_keeps_every_seed_and_their_spread() -> None:
    summary = stats.mean_std([0.5, 0.7, 0.6])
    assert summary["seeds"] == [0.5, 0.7, 0.6]
    assert (summary["mean"], summary["std"], summary["spread"]) == pytest.approx((0.6, 0.1, 0.2))


def test_over_seeds_spreads_the_scores_and_averages_the_costs() -> None:
    summary = stats.over_seeds(
        {"accuracy": [0.5, 0.7, 0.6], "wall_seconds": [10.0, 20.0, 30.0]}, means_only=("wall_seconds",)
    )
    assert summary == {"accuracy": stats.mean_std([0.5, 0.7, 0.6]), "wall_seconds": 20.0}
    assert summary["accuracy"]["seeds"] == [0.5, 0.7, 0.6]  # in seed order, for the paired claims
    with pytest.raises(ValueError, match="means_only names figures not given: seconds"):
        stats.over_seeds({"accuracy": [0.5]}, means_only=("seconds",))
