"""Paired statistics over items: bootstrap intervals of differences and McNemar's exact test."""
from __future__ import annotations

import numpy as np
from scipy.stats import binomtest


def paired_bootstrap(a, b, iters: int = 2000, seed: int = 0, statistic=np.mean) -> dict:
    """Mean of a - b over the same items, with a 95% percentile interval from resampling items."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired samples must be equal-length vectors, got {a.shape} and {b.shape}")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(a), size=(iters, len(a)))  # (iters, n): item indices per resample
    diffs = statistic(a[picks], axis=1) - statistic(b[picks], axis=1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return {"diff": float(statistic(a) - statistic(b)), "low": float(low), "high": float(high), "n": int(len(a))}


def mcnemar(a, b) -> float:
    """Exact two-sided McNemar p-value for paired 0/1 outcomes (binomial test on the discordant pairs)."""
    a, b = np.asarray(a).astype(bool), np.asarray(b).astype(bool)
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    if only_a + only_b == 0:
        return 1.0
    return float(binomtest(only_a, only_a + only_b, 0.5).pvalue)
