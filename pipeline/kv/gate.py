"""Selective handoff: a per-request score computed from the handoff's first step only (`kv.scores`), never the
target's prefill, and the gate that falls back to the target's own prefill where score > threshold: +inf is the
ungated handoff, -inf the oracle everywhere. A one-token context hands off nothing: its score is -inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from pipeline.kv.handoff import FirstStep, Handoff
from pipeline.kv.kvcache import padded_prefixes
from pipeline.kv.scores import INPUTS, SCORES, Evidence, Score, refusal
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")

REFERENCES = ("oracle", "random")  # the upper bound and the null: curves of the stage, not request-time scores


def map_pair(spec: str) -> tuple[str, str] | None:
    """The `disagree` score's two mapper files from `K1:KMAX` (k=1 and k=max), or None for another count."""
    files = tuple(spec.split(":"))
    return files if len(files) == 2 else None


def float64(values) -> torch.Tensor:
    """(N,) float64 on the CPU of a tensor, array, Series or list (copied: pandas hands out read-only arrays)."""
    if isinstance(values, torch.Tensor):
        return values.double().cpu()
    return torch.tensor([float(value) for value in values], dtype=torch.float64)


@dataclass
class Probe:
    """Logistic regression on first-step features: score = ((x - mean) / scale) . weights + bias, the logit of "the
    map changes the decision"."""

    features: tuple[str, ...]
    mean: list[float]
    scale: list[float]
    weights: list[float]
    bias: float

    def __call__(self, values: Mapping[str, Sequence[float]]) -> torch.Tensor:
        """The probe's score (N,) of features (each (N,)); -inf where a feature is (a context handing off nothing)."""
        x = torch.stack([float64(values[name]) for name in self.features], -1)  # (N, F)
        mean, scale, weights = (torch.tensor(v, dtype=x.dtype) for v in (self.mean, self.scale, self.weights))
        logit = ((x - mean) / scale) @ weights
        return torch.where(torch.isfinite(x).all(-1), logit + self.bias, float("-inf"))


def fit_probe(values: Mapping[str, Sequence[float]], labels: Sequence[bool], features: Sequence[str], l2: float,
              steps: int = 50) -> Probe:
    """The L2-penalised (`l2` on the standardised weights, not the bias) logistic regression of `labels` (N,) on
    `features` of `values`, by Newton's method from zero in float64: deterministic. Rows with a non-finite
    feature are left out; labels of one class give a constant probe (nothing to tell apart)."""
    x = torch.stack([float64(values[name]) for name in features], -1)  # (N, F)
    y = float64(labels)  # (N,)
    keep = torch.isfinite(x).all(-1)
    x, y = x[keep], y[keep]
    mean, scale = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-12)
    if len(y.unique()) < 2:
        return Probe(tuple(features), mean.tolist(), scale.tolist(), [0.0] * len(features), 0.0)
    design = torch.cat([(x - mean) / scale, torch.ones(len(x), 1, dtype=x.dtype)], -1)  # (N, F + 1), bias last
    penalty = torch.diag(torch.tensor([l2] * len(features) + [0.0], dtype=x.dtype))
    theta = torch.zeros(len(features) + 1, dtype=x.dtype)
    for _ in range(steps):
        p = torch.sigmoid(design @ theta)
        gradient = design.T @ (p - y) + penalty @ theta
        hessian = design.T @ (design * (p * (1 - p))[:, None]) + penalty + 1e-9 * torch.eye(len(theta), dtype=x.dtype)
        theta = theta - torch.linalg.solve(hessian, gradient)
    return Probe(tuple(features), mean.tolist(), scale.tolist(), theta[:-1].tolist(), float(theta[-1]))


class Scorer:
    """The scores of requests handed off through `handoff` (a source mode), from its first step only. `disagree`:
    the two mapped handoffs (k=1 and k=max) the `disagree` score compares; `scores`: the registry it reads."""

    def __init__(self, handoff: Handoff, disagree: tuple[Handoff, Handoff] | None = None, probe: Probe | None = None,
                 scores: Mapping[str, Score] = SCORES):
        if handoff.source is None:
            raise ValueError(f"scores read the source's prefill; the {handoff.mode!r} handoff has no source")
        self.handoff, self.disagree, self.probe, self.registry = handoff, disagree, probe, scores
        self.known = {**scores, **INPUTS}  # every score or feature it computes, by name
        self.source_alone = Handoff(handoff.source, mode="source")  # the source's own step after its own cache

    def check(self, names: Sequence[str]) -> None:
        """Refuse a name its registry does not hold, or one whose needs (maps, a probe) it was not given."""
        reason = refusal(names, self, self.registry)
        if reason:
            raise ValueError(reason)

    @no_grad
    def scores(self, contexts: Sequence[Sequence[int]], names: Sequence[str], batch_size: int = 16,
               keep: dict | None = None) -> dict[str, torch.Tensor]:
        """Each named score or feature (N,), float64 on the CPU, of contexts c[0..n-1]; `keep`: filled with each
        prefix's cache from the handoff's first step, for the router to score its continuations on."""
        self.check(names)
        out = {name: torch.full((len(contexts),), float("-inf"), dtype=torch.float64) for name in names}
        rows = [row for row, context in enumerate(contexts) if len(context) >= 2]  # the others hand off nothing
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            first = self.handoff.first_step(padded_prefixes([contexts[row] for row in chunk]), retain=True)
            for name, values in self.step_scores(first, names).items():
                out[name][chunk] = values
            if keep is not None:
                keep.update(first.kept())
        return out

    def step_scores(self, first: FirstStep, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each named score or feature (B,), float64 on the CPU, of a `retain`ed first step of the handoff."""
        evidence = Evidence(first, self)
        for name in self.needed(names):
            evidence.values[name] = self.known[name].score(evidence).double().cpu()
        return {name: evidence.values[name] for name in names}

    def needed(self, names: Sequence[str]) -> list[str]:
        """What is computed for `names`, each once, what an entry reads (the probe: its features) before it."""
        order: dict[str, None] = {}
        for name in names:
            order.update(dict.fromkeys(self.needed(self.known[name].reads(self))))
            order[name] = None
        return list(order)


class Gate:
    """Per request: fall back to `fallback` (the target's own prefill) where the score exceeds `threshold`."""

    def __init__(self, scorer: Scorer, score: str, threshold: float, fallback: Handoff):
        scorer.check([score])
        if fallback.mode != "oracle":
            raise ValueError(f"a gate falls back to the target's own prefill (oracle), not {fallback.mode!r}")
        self.scorer, self.score, self.threshold, self.fallback = scorer, score, float(threshold), fallback

    def route(self, contexts: Sequence[Sequence[int]], batch_size: int = 16, keep: dict | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (N,) and whether each request falls back (N,) bool; `keep`: as `Scorer.scores`."""
        scores = self.scorer.scores(contexts, [self.score], batch_size, keep)[self.score]
        return scores, self.falls_back(scores)

    def falls_back(self, scores: torch.Tensor) -> torch.Tensor:
        """Whether each request of `scores` (N,) falls back: score > threshold, or every one at threshold -inf (a
        one-token context's score is -inf, and -inf > -inf is false)."""
        return (scores > self.threshold) | (self.threshold == float("-inf"))
