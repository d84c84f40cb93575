"""Selective handoff measured: quality against fallback rate, AUROC, the threshold for a declared quality, speedup.

A gated system answers with the target's own prefill (the oracle) where it falls back and with the mapped handoff
elsewhere, so its outcome per request is read off the two ungated runs. Two reference gates: the oracle gate falls
back exactly where the map changes the decision (the upper bound), a random gate in a seeded random order (the null).
"""
from __future__ import annotations

from typing import Callable

from pipeline.measure.retention import gap_closure, retention
from pipeline.measure.tasks import CHANCE
from pipeline.store.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")
scipy_stats = lazy("scipy.stats")


def auroc(scores, labels) -> float:
    """Area under the ROC curve of `scores` for the 0/1 `labels` (ties count one half); NaN with one class."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels).astype(bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    ranks = scipy_stats.rankdata(scores)  # average ranks: a tie between classes counts one half
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def auroc_interval(scores, labels, iters: int, seed: int) -> tuple[float, float]:
    """95% percentile interval of `auroc` from resampling the requests within each class (both classes' counts
    kept, so every draw has both); NaN, NaN with one class."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels).astype(bool)
    positives, negatives = scores[labels], scores[~labels]
    if len(positives) == 0 or len(negatives) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    drawn = np.concatenate([positives[rng.integers(0, len(positives), (iters, len(positives)))],
                            negatives[rng.integers(0, len(negatives), (iters, len(negatives)))]], axis=1)  # (iters, N)
    ranks = scipy_stats.rankdata(drawn, axis=1)[:, : len(positives)]  # (iters, positives)
    count = len(positives)
    areas = (ranks.sum(axis=1) - count * (count + 1) / 2) / (count * len(negatives))  # (iters,)
    low, high = np.percentile(areas, [2.5, 97.5])
    return float(low), float(high)


def decisions(frame: pd.DataFrame, metric: str) -> np.ndarray:
    """The chosen choice per item (N,) from its `loglikelihoods` and, for acc_norm, its `choices` (lm-eval's
    continuations, the target delimiter first: the choice's own characters are the rest)."""
    if metric == "acc":
        return np.array([int(np.argmax(lls)) for lls in frame.loglikelihoods])
    return np.array([int(np.argmax(np.asarray(lls) / np.array([len(c[1:] if c.startswith(" ") else c)
                                                                for c in choices])))
                     for lls, choices in zip(frame.loglikelihoods, frame.choices)])


def reference_scores(changed, seed: int) -> dict[str, np.ndarray]:
    """The oracle gate's score (1 where the map changes the decision) and the random gate's (seeded draws). The map
    changes the decision of a task item whose chosen answer (`decisions`) differs from the oracle's, and of a prompt
    whose first greedy token differs from the oracle's."""
    changed = np.asarray(changed, dtype=float)
    return {"oracle": changed, "random": np.random.default_rng(seed).random(len(changed))}


def gated(items: pd.DataFrame, fallback) -> np.ndarray:
    """Outcome per item (N,): the oracle's where it falls back, the map's elsewhere."""
    return np.where(np.asarray(fallback, dtype=bool), items.oracle.to_numpy(), items["mapped"].to_numpy())


def item_quality(items: pd.DataFrame, fallback) -> dict[str, float]:
    """Retention and gap closure (means over tasks) of the gated system with `fallback` (N,) bool; `items` columns
    task, mapped, oracle and, for the gap closure, source hold 0/1 outcomes. On arrays: a threshold search calls it
    once per distinct score."""
    outcome, tasks = gated(items, fallback), items.task.to_numpy()
    oracle, source = items.oracle.to_numpy(), items.source.to_numpy() if "source" in items else None
    kept, closed = [], []
    for task in sorted(set(tasks)):
        rows = tasks == task
        kept.append(retention(outcome[rows].mean(), oracle[rows].mean(), CHANCE[task]))
        if source is not None:
            closed.append(gap_closure(outcome[rows].mean(), source[rows].mean(), oracle[rows].mean()))
    return {"retention": float(np.mean(kept)), "gap_closure": float(np.mean(closed)) if closed else float("nan")}


def gated_first(prompts: pd.DataFrame, fallback) -> np.ndarray:
    """First-token agreement with the oracle per prompt (N,): 1 where it falls back."""
    return np.where(np.asarray(fallback, dtype=bool), 1, prompts.first_agree.to_numpy())


def prompt_quality(prompts: pd.DataFrame, fallback) -> dict[str, float]:
    """Next-token top-1 and rollout agreement with the oracle (a fallback agrees everywhere), and where column
    `confident` marks prompts whose first-token oracle top-2 margin reaches the confident margin, the top-1 over them
    (NaN without any)."""
    fallback = np.asarray(fallback, dtype=bool)
    first = gated_first(prompts, fallback)
    rollout = np.where(fallback, prompts.horizon.to_numpy(), prompts.rollout_agree.to_numpy())
    quality = {"next_token_top1": float(first.mean()),
               "rollout_agreement": float(rollout.sum() / prompts.horizon.sum())}
    if "confident" in prompts:
        sure = prompts.confident.to_numpy(bool)
        quality["confident_top1"] = float(first[sure].mean()) if sure.any() else float("nan")
    return quality


def curve(frame: pd.DataFrame, scores, quality: Callable, rates, seed: int) -> list[dict]:
    """Quality at each fallback rate of `rates`, falling back on the round(rate x N) least trusted requests."""
    scores = np.asarray(scores, dtype=float)
    shuffle = np.random.default_rng(seed).permutation(len(scores))
    ranked = shuffle[np.argsort(-scores[shuffle], kind="stable")]  # least to most trusted, ties in a seeded order
    rows = []
    for rate in rates:
        fallback = np.zeros(len(frame), dtype=bool)
        fallback[ranked[: int(round(rate * len(frame)))]] = True
        rows.append({"fallback_rate": float(fallback.mean()), **quality(frame, fallback)})
    return rows


def choose_threshold(scores, quality: Callable[[np.ndarray], float], target: float) -> float:
    """The highest threshold t whose gate (fall back where score > t) reaches `target` quality: +inf when the
    ungated handoff does, -inf (everything falls back) when no finite one does."""
    scores = np.asarray(scores, dtype=float)
    for threshold in [np.inf, *np.unique(scores[np.isfinite(scores)])[::-1]]:
        if quality(scores > threshold) >= target:
            return float(threshold)
    return float("-inf")


def effective_speedup(target: float, handoff: float, score: float, rate: float) -> float:
    """Target prefill against the gated system at fallback rate `rate` (times or multiply-adds per request): every
    request pays the handoff and its score, a fallback also the target's prefill."""
    return target / (handoff + score + rate * target)
