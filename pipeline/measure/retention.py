"""PROTOCOL's normalized retention and paired comparisons of two variants on the same items and prompts.

Retention of a task: (acc_variant - chance) / (acc_oracle - chance); a variant's retention is the mean over
tasks. Intervals are paired bootstraps (items resampled per task, the same draw for both sides); task
decisions and next-token agreement are compared item by item with exact McNemar tests.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from pipeline.measure.stats import mcnemar, paired_bootstrap
from pipeline.measure.tasks import CHANCE
from pipeline.store.splits import TASKS


def retention(acc_variant: float, acc_oracle: float, chance: float) -> float:
    """PROTOCOL's normalized retention for one task: (acc_variant - chance) / (acc_oracle - chance)."""
    if acc_oracle <= chance:
        return float("nan")  # the oracle itself is at chance: nothing to retain
    return (acc_variant - chance) / (acc_oracle - chance)


def mean_retention(acc: dict[str, float], oracle: dict[str, float]) -> float:
    return float(np.mean([retention(acc[t], oracle[t], CHANCE[t]) for t in TASKS]))


def paired_items(items: dict[str, pd.DataFrame], a: str, b: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """0/1 outcomes of variants a and b on the same items, both tasks concatenated."""
    left = items[a].set_index(["task", "item"])[metric]
    right = items[b].set_index(["task", "item"])[metric]
    joined = pd.concat([left.rename("a"), right.rename("b")], axis=1, join="inner")
    return joined.a.to_numpy(), joined.b.to_numpy()


def retention_interval(items: dict[str, pd.DataFrame], variant: str, metric: str, iters: int, seed: int) -> dict:
    """Paired bootstrap of mean retention: items resampled per task, the same draw for variant and oracle."""
    rng = np.random.default_rng(seed)
    draws = np.zeros(iters)
    point = []
    for task in TASKS:
        v = items[variant][items[variant].task == task].sort_values("item")[metric].to_numpy()
        o = items["oracle"][items["oracle"].task == task].sort_values("item")[metric].to_numpy()
        picks = rng.integers(0, len(v), size=(iters, len(v)))
        acc_v, acc_o = v[picks].mean(1), o[picks].mean(1)
        chance = CHANCE[task]
        with np.errstate(divide="ignore", invalid="ignore"):
            draws += np.where(acc_o > chance, (acc_v - chance) / (acc_o - chance), np.nan) / len(TASKS)
        point.append(retention(v.mean(), o.mean(), chance))
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return {"retention": float(np.mean(point)), "low": float(low), "high": float(high)}


def comparison(items, prompts, a: str, b: str, metric: str, iters: int, seed: int) -> dict:
    x, y = paired_items(items, a, b, metric)
    tasks = paired_bootstrap(x, y, iters, seed)
    pa, pb = prompts[a].sort_values("prompt"), prompts[b].sort_values("prompt")
    agreement = paired_bootstrap(pa.first_agree.to_numpy(), pb.first_agree.to_numpy(), iters, seed)
    return {"tasks_diff": tasks["diff"], "tasks_low": tasks["low"], "tasks_high": tasks["high"], "tasks_n": tasks["n"],
            "tasks_mcnemar_p": mcnemar(x, y), "next_token_diff": agreement["diff"], "next_token_low": agreement["low"],
            "next_token_high": agreement["high"], "next_token_n": agreement["n"],
            "next_token_mcnemar_p": mcnemar(pa.first_agree.to_numpy(), pb.first_agree.to_numpy())}
