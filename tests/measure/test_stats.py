"""Paired statistics: intervals cover what they should and exclude 0 only for real differences."""
import numpy as np
import pytest
import scipy.stats

from pipeline.measure.stats import mcnemar, paired_bootstrap, pareto_front, rank_correlation, sign_test


def test_bootstrap_excludes_zero_for_a_clear_difference():
    rng = np.random.default_rng(0)
    a = (rng.random(400) < 0.9).astype(float)
    b = (rng.random(400) < 0.5).astype(float)
    result = paired_bootstrap(a, b)
    assert result["low"] > 0 and result["low"] < result["diff"] < result["high"]


def test_bootstrap_includes_zero_for_identical_distributions():
    rng = np.random.default_rng(1)
    a = (rng.random(200) < 0.6).astype(float)
    b = rng.permutation(a)
    result = paired_bootstrap(a, b)
    assert result["low"] <= 0 <= result["high"]


def test_mcnemar():
    a = np.array([1] * 30 + [0] * 70)
    assert mcnemar(a, a) == 1.0
    b = np.array([0] * 30 + [0] * 70)
    assert mcnemar(a, b) < 1e-6


def test_rank_correlation_is_one_for_any_increasing_relation_and_minus_one_for_a_decreasing_one():
    x = np.array([0.1, 0.4, 0.2, 0.9, 0.5, 0.7])
    up, down = rank_correlation(x, np.exp(5 * x), iters=200), rank_correlation(x, -x**3, iters=200)
    assert up["rho"] == 1.0 and down["rho"] == -1.0 and up["p"] < 0.01 and up["n"] == 6
    assert up["low"] <= 1.0 <= up["high"] and down["high"] <= -0.99
    noise = rank_correlation(x, np.array([0.3, 0.1, 0.6, 0.2, 0.5, 0.4]), iters=200)
    assert noise["low"] < 0 < noise["high"]  # no relation: the interval spans 0
    assert np.isnan(rank_correlation(x, np.ones(6))["rho"])  # a constant side has no ranks to correlate
    assert np.isnan(rank_correlation(x[:2], x[:2])["rho"])


@pytest.mark.parametrize("ties", [False, True])
def test_the_rank_correlations_interval_is_that_of_scipys_spearmanr_on_each_resample_to_the_bit(ties):
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=7), rng.normal(size=7)
    if ties:  # tied ranks, and resamples with a constant side (undefined, left out)
        x, y = np.round(x), np.round(y * 2) / 2
    draws = []
    for picks in np.random.default_rng(5).integers(0, 7, size=(300, 7)):
        xs, ys = x[picks], y[picks]
        draws.append(scipy.stats.spearmanr(xs, ys).statistic if np.ptp(xs) > 0 and np.ptp(ys) > 0 else np.nan)
    result = rank_correlation(x, y, iters=300, seed=5)
    assert [result["low"], result["high"]] == list(np.nanpercentile(draws, [2.5, 97.5]))
    assert result["rho"] == scipy.stats.spearmanr(x, y).statistic


def test_the_pareto_front_keeps_exactly_the_points_no_other_beats_on_both_figures():
    quality = [0.9, 0.5, 0.8, 0.4, 0.9, float("nan")]
    speed = [1.0, 3.0, 2.0, 2.5, 0.5, 9.0]
    # (0.9, 1.0) beats (0.9, 0.5); (0.8, 2.0) and (0.5, 3.0) trade off; (0.4, 2.5) loses to (0.5, 3.0)
    assert pareto_front(quality, speed) == [True, True, True, False, False, False]


def test_the_sign_test_counts_the_lower_side_and_ignores_ties():
    a, b = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0]), np.array([2.0, 3.0, 4.0, 5.0, 6.0, 5.0])
    result = sign_test(a, b)
    assert (result["lower"], result["higher"]) == (5, 0) and result["p"] == pytest.approx(2 / 32)
    assert sign_test(a, a)["p"] == 1.0
