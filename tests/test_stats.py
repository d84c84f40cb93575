"""Paired statistics: intervals cover what they should and exclude 0 only for real differences."""
import numpy as np

from pipeline.measure.stats import mcnemar, paired_bootstrap


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
