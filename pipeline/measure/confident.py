"""Agreement with the oracle where it is sure, and weighted by it: top-1 agreement counts a near-tie of the oracle's
two best tokens as a coin flip the map must win, so it measures the tie, not the map."""
from __future__ import annotations

from pipeline.store.lazy import lazy

np = lazy("numpy")
pd = lazy("pandas")
torch = lazy("torch")

MARGINS, PROBABILITIES = "margin_by_position", "oracle_prob_by_position"  # the per-prompt rows' list columns


def oracle_margin(top_logprobs: torch.Tensor) -> torch.Tensor:
    """p1 - p2 per position (m,) from top-K log-probabilities (m, K); with K = 1, p2 is bounded by the rest, 1 - p1."""
    p = top_logprobs.exp()  # (m, K)
    second = p[:, 1] if p.shape[-1] > 1 else (1 - p[:, 0]).clamp_min(0.0)
    return p[:, 0] - second


def oracle_probability(top_logprobs: torch.Tensor, top_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per position (m,): the oracle's probability of `tokens` (m,) where among its top-K, else 0 (a lower bound)."""
    hit = top_ids == tokens[:, None]  # (m, K)
    return (top_logprobs.exp() * hit).sum(-1)


def _share(hits, count: int) -> float | None:
    return float(np.sum(hits) / count) if count else None


def confident_prompts(rows: pd.DataFrame, margin: float) -> np.ndarray:
    """Per prompt (N,): the oracle is sure at the first position after it (margin >= `margin`)."""
    return np.array([np.asarray(m, dtype=float)[0] >= margin for m in rows[MARGINS]], dtype=bool)


def _arrays(rows: pd.DataFrame, margin: float) -> tuple:
    """Per prompt (N,): first position confident, first agreement; per position (P,): its prompt, confident, agreeing
    and the oracle's probability of the variant's argmax."""
    margins = [np.asarray(m, dtype=float) for m in rows[MARGINS]]
    first = confident_prompts(rows, margin)  # (N,)
    owner = np.concatenate([np.full(len(m), i) for i, m in enumerate(margins)])  # (P,)
    confident = np.concatenate(margins) >= margin  # (P,)
    agree = np.concatenate([np.asarray(a, dtype=float) for a in rows.agree_by_position])  # (P,)
    probability = np.concatenate([np.asarray(p, dtype=float) for p in rows[PROBABILITIES]])  # (P,)
    return first, rows.first_agree.to_numpy(float), owner, confident, agree, probability


def confidence_summary(rows: pd.DataFrame, margin: float) -> dict[str, float | int | None]:
    """confident_top1: V0's column over the prompts whose first position has margin >= `margin`; confident_agreement:
    over every such position; oracle_weighted_agreement: the mean oracle probability of the variant's argmax. A share
    over none is None (the report's "n/a")."""
    first, first_agree, _, confident, agree, probability = _arrays(rows, margin)
    prompts, positions = int(first.sum()), int(confident.sum())
    return {
        "confident_top1": _share(first_agree[first], prompts), "confident_prompts": prompts,
        "confident_prompt_share": _share(first, len(first)),
        "confident_agreement": _share(agree[confident], positions), "confident_positions": positions,
        "confident_position_share": _share(confident, len(confident)),
        "oracle_weighted_agreement": _share(probability, len(probability)),
    }


def confidence_intervals(rows: pd.DataFrame, margin: float, iters: int, seed: int) -> dict[str, float | None]:
    """95% percentile intervals (`<figure>_low`, `_high`) from resampling prompts (a prompt's positions together)."""
    first, first_agree, owner, confident, agree, probability = _arrays(rows, margin)
    count = len(first)
    picks = np.random.default_rng(seed).integers(0, count, size=(iters, count))  # (iters, N)
    weights = np.stack([np.bincount(p, minlength=count) for p in picks])  # (iters, N): times each prompt is drawn

    def ratio(numerator, denominator) -> tuple[float | None, float | None]:
        if not denominator.sum():
            return None, None
        with np.errstate(divide="ignore", invalid="ignore"):
            draws = weights @ numerator / (weights @ denominator)  # (iters,), NaN where a draw has none
        low, high = np.nanpercentile(draws, [2.5, 97.5])
        return float(low), float(high)

    def per_prompt(values) -> np.ndarray:
        return np.bincount(owner, weights=values, minlength=count)  # (N,)

    bounds = {"confident_top1": ratio(first_agree * first, first.astype(float)),
              "confident_agreement": ratio(per_prompt(agree * confident), per_prompt(confident.astype(float))),
              "oracle_weighted_agreement": ratio(per_prompt(probability), per_prompt(np.ones_like(probability)))}
    return {f"{name}_{end}": value for name, pair in bounds.items() for end, value in zip(("low", "high"), pair)}

