"""Selective handoff: a per-request confidence score computed without the target's prefill, and the gate that
falls back to the target's own prefill where the mapped cache is not trusted.

Every score reads the handoff's first step only (PROTOCOL.md, "Handoff"; the step the handoff runs anyway to
give the first token), so its cost is that step's work plus at most one extra token of a model (the probe: its
features' and one pass over both caches for their norms):

    source body:  c[0] ... c[n-2]                 -> cache                (the handoff's own prefill)
    source step:  c[n-1] after its own cache       -> p_source(. | c)      (`kl` only: one source token + logits)
    map:          source cache -> target cache(s)                          (`disagree`: both of its maps)
    norms:        source and mapped caches       -> mean key, value norms  (`probe` only)
    target step:  c[n-1] after the mapped cache    -> p_target(. | mapped) (the handoff's own first step)

Scores, higher = less trusted:

    entropy   H(p_target(. | mapped)): the target unsure of its next token after the handoff
    kl        KL(p_source || p_target(. | mapped)): the target after the handoff far from what the source predicts
    disagree  JS(p_target(. | map a), p_target(. | map b)): two maps (k=1 and k=max) disagree on the first step
    probe     a logistic regression's logit for "the map changes the decision" from the first step's features
              (`FEATURES`: the three scores above, the target's top-1 probability, and the log-ratio of the mapped
              cache's mean key and value norms to the source cache's), trained by the stage on dev items only

Every score is read off one `Handoff.first_step` of the gated handoff (retained: the source's cache and the mapped
one), whose prefix cache the router keeps for the context's scoring (`FirstStep.kept`, `kv.router`).

A context of one token has an empty prefix: nothing is handed off, the handoff is the oracle, its score -inf.
The `Gate` falls back where score > threshold: threshold +inf is the ungated handoff, -inf the oracle everywhere
(one-token contexts included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.handoff import FirstStep, Handoff
from pipeline.kv.kvcache import Layers, kv_geometry, padded_prefixes
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")

SCORES = ("entropy", "kl", "disagree", "probe")
FITTED = ("probe",)  # scores that need a probe the stage trained: not for a gate named by arguments alone
FEATURES = ("entropy", "kl", "disagree", "top1", "key_norm", "value_norm")  # a probe's inputs (first step only)
REFERENCES = ("oracle", "random")  # the upper bound and the null: curves of the stage, not request-time scores


def map_pair(spec: str) -> tuple[str, str] | None:
    """The `disagree` score's two mapper files from `K1:KMAX` (k=1 and k=max), or None where it names another
    count."""
    files = tuple(spec.split(":"))
    return files if len(files) == 2 else None


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) of next-token log-probabilities (B, V)."""
    return -(logprobs.exp() * logprobs).sum(-1)


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) (B,) of log-probabilities (B, V) over their common vocabulary (a padded vocabulary's tail cut)."""
    vocab = min(p_logprobs.shape[-1], q_logprobs.shape[-1])
    p, q = p_logprobs[..., :vocab], q_logprobs[..., :vocab]
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


def jensen_shannon(a_logprobs: torch.Tensor, b_logprobs: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (B,) of two next-token log-probabilities (B, V), in nats (at most log 2)."""
    middle = torch.logsumexp(torch.stack([a_logprobs, b_logprobs]), dim=0) - torch.log(torch.tensor(2.0))
    return 0.5 * (kl(a_logprobs, middle) + kl(b_logprobs, middle))


def score_macs(name: str, source_config, target_config, second_map_macs: int, length: int,
               features: Sequence[str] = FEATURES) -> int:
    """Multiply-adds a score adds to the handoff of a prompt of `length` tokens (the handoff's own first step
    is not counted again): `entropy` one per logit; `kl` the source's step on c[n-1] with its logits;
    `disagree` a second map (`second_map_macs` per token) over the prefix and a second target step; `probe`
    the scores among its `features`, a pass over the logits (top-1), one over both caches (norms) and its dot
    product."""
    prefix = length - 1
    if name == "probe":
        source, target = kv_geometry(source_config), kv_geometry(target_config)
        norms = prefix * sum(geometry["layers"] * geometry["kv_heads"] * geometry["head_dim"] * 2
                             for geometry in (source, target))
        return (sum(score_macs(feature, source_config, target_config, second_map_macs, length)
                    for feature in features if feature in SCORES) + target_config.vocab_size + norms + len(features))
    if name == "entropy":
        return target_config.vocab_size
    if name == "kl":
        return (linear_macs_per_token(source_config) + attention_macs(source_config, prefix, length)
                + logits_macs(source_config) + source_config.vocab_size)
    if name == "disagree":
        return (prefix * second_map_macs + linear_macs_per_token(target_config)
                + attention_macs(target_config, prefix, length) + logits_macs(target_config))
    raise ValueError(f"unknown score {name!r} (known: {', '.join(SCORES)})")


def mean_norms(layers: Layers, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean key and value norms (B,) of a cache over its layers, heads and real tokens (`mask` (B, T))."""
    weights = mask.float() / (mask.float().sum(-1, keepdim=True) * len(layers))  # (B, T)
    keys, values = (sum((tensors[side].float().norm(dim=-1).mean(1).cpu() * weights).sum(-1)  # (B, H, T) -> (B,)
                        for tensors in layers) for side in (0, 1))
    return keys, values


def float64(values) -> torch.Tensor:
    """(N,) float64 on the CPU of a tensor, array, Series or list (copied: pandas hands out read-only arrays)."""
    if isinstance(values, torch.Tensor):
        return values.double().cpu()
    return torch.tensor([float(value) for value in values], dtype=torch.float64)


@dataclass
class Probe:
    """Logistic regression on first-step features: score = ((x - mean) / scale) . weights + bias, the logit of "the
    map changes the decision". Fitted by `fit_probe`."""

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
    """The scores of requests handed off through `handoff` (a source mode), from its first step only.

    `disagree`: the two mapped handoffs (k=1 and k=max) whose first steps the `disagree` score compares; they
    share `handoff`'s source prefill. `probe`: the fitted probe of the `probe` score. No score reads the target's
    prefill of the prompt (tests make it fail)."""

    def __init__(self, handoff: Handoff, disagree: tuple[Handoff, Handoff] | None = None, probe: Probe | None = None):
        if handoff.source is None:
            raise ValueError(f"scores read the source's prefill; the {handoff.mode!r} handoff has no source")
        self.handoff, self.disagree, self.probe = handoff, disagree, probe
        self.source_alone = Handoff(handoff.source, mode="source")  # the source's own step after its own cache

    def check(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in SCORES and name not in FEATURES:
                raise ValueError(f"unknown score {name!r} (known: {', '.join(SCORES)})")
            if name == "disagree" and self.disagree is None:
                raise ValueError("the 'disagree' score needs its two maps (k=1 and k=max)")
            if name == "probe" and self.probe is None:
                raise ValueError("the 'probe' score needs a probe fitted on dev items (the selective stage fits one)")
        if "probe" in names:
            self.check(self.probe.features)

    @no_grad
    def scores(self, contexts: Sequence[Sequence[int]], names: Sequence[str], batch_size: int = 16,
               keep: dict | None = None) -> dict[str, torch.Tensor]:
        """Each named score or feature (N,), float64 on the CPU, of contexts c[0..n-1], `batch_size` contexts a
        forward (`probe`: its features first, then the probe); `keep`: filled with each prefix's cache from the
        handoff's first step (`FirstStep.kept`), for the router to score its continuations on."""
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
        """Each named score or feature (B,), float64 on the CPU, of a first step of the handoff (`retain`ed)."""
        out = {name: values.double().cpu() for name, values in self.of_step(first, self.needed(names)).items()}
        if "probe" in names:
            out["probe"] = self.probe(out)
        return {name: out[name] for name in names}

    def needed(self, names: Sequence[str]) -> list[str]:
        """What is computed from a first step for `names`: the scores but the probe, and the probe's features."""
        probe = self.probe.features if "probe" in names else ()
        return list(dict.fromkeys([*(name for name in names if name != "probe"), *probe]))

    def of_step(self, first: FirstStep, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each score or feature of `names` but the probe (B,) from the handoff's first step (retained: its source
        and mapped caches), and from the steps it shares that step's source prefill with."""
        prefixes, target = first.prefixes, first.logprobs  # (B, V) after the handoff's cache
        out = {}
        if "top1" in names:
            out["top1"] = target.max(-1).values.exp()
        if "key_norm" in names or "value_norm" in names:
            (mapped_keys, mapped_values), (source_keys, source_values) = (mean_norms(layers, prefixes.mask)
                                                                          for layers in (first.mapped, first.source))
            out["key_norm"] = (mapped_keys / source_keys).log()
            out["value_norm"] = (mapped_values / source_values).log()
        if "entropy" in names:
            out["entropy"] = entropy(target)
        if "kl" in names:
            source = self.source_alone.first_step(prefixes, prefilled=first.source).logprobs  # (B, V_s)
            out["kl"] = kl(source.to(target.device), target)
        if "disagree" in names:
            first_map, second_map = (target if handoff is self.handoff else
                                     handoff.first_step(prefixes, prefilled=first.source).logprobs
                                     for handoff in self.disagree)
            out["disagree"] = jensen_shannon(first_map, second_map.to(first_map.device))
        return out


class Gate:
    """Per request: fall back to `fallback` (the target's own prefill) where the score exceeds `threshold`."""

    def __init__(self, scorer: Scorer, score: str, threshold: float, fallback: Handoff):
        scorer.check([score])
        if fallback.mode != "oracle":
            raise ValueError(f"a gate falls back to the target's own prefill (oracle), not {fallback.mode!r}")
        self.scorer, self.score, self.threshold, self.fallback = scorer, score, float(threshold), fallback

    def route(self, contexts: Sequence[Sequence[int]], batch_size: int = 16, keep: dict | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (N,) and whether each request falls back (N,) bool: every one at threshold -inf, a one-token
        context too (its score is -inf, and -inf > -inf is false); `keep`: as `Scorer.scores`."""
        scores = self.scorer.scores(contexts, [self.score], batch_size, keep)[self.score]
        return scores, self.falls_back(scores)

    def falls_back(self, scores: torch.Tensor) -> torch.Tensor:
        """Whether each request of `scores` (N,) falls back: score > threshold, or every one at threshold -inf."""
        return (scores > self.threshold) | (self.threshold == float("-inf"))
