"""The gate's scores: how little a handed-off request is trusted (higher: less), read off the gated handoff's first
step only; `SCORES` lists them and `INPUTS` the probe's other inputs. Shapes: B contexts; a score (B,).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, NamedTuple, Sequence

from pipeline.kv import entries
from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.geometry import kv_geometry
from pipeline.store.lazy import lazy

torch = lazy("torch")

MAPS = "maps"  # a need: the scorer's two mapped handoffs (k=1 and k=max)
PROBE = "probe"  # a need: a probe the selective stage fitted on dev items


class Work(NamedTuple):
    """What a score's multiply-adds are counted from, for a prompt of `length` tokens."""

    source_config: object
    target_config: object
    second_map_macs: int  # `disagree`'s second map, per token
    length: int
    features: tuple[str, ...]  # the probe's inputs
    scores: Mapping[str, "Score"]  # the registry the probe counts its scores' costs from


def mean_norms(layers: list, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean key and value norms (B,) of a cache over its layers, heads and real tokens (`mask` (B, T))."""
    weights = mask.float() / (mask.float().sum(-1, keepdim=True) * len(layers))  # (B, T)
    keys, values = (sum((tensors[side].float().norm(dim=-1).mean(1).cpu() * weights).sum(-1)  # (B, H, T) -> (B,)
                        for tensors in layers) for side in (0, 1))
    return keys, values


@dataclass
class Evidence:
    """What a score may read of one first step."""

    first: object  # kv.handoff.FirstStep of the gated handoff, retained: its source and mapped caches
    scorer: object  # kv.gate.Scorer: the gated handoff, the source alone, the two maps, the probe
    values: dict = field(default_factory=dict)  # the scores and features computed so far, (B,) float64 on the CPU

    @cached_property
    def logprobs(self) -> torch.Tensor:
        """(B, V) float32 log-probabilities of the target after the handed-off cache."""
        return self.first.logprobs

    @cached_property
    def norms(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((keys, values) of the mapped cache, (keys, values) of the source's), each (B,): `mean_norms`."""
        mask = self.first.prefixes.mask
        return mean_norms(self.first.mapped, mask), mean_norms(self.first.source, mask)


class Score(ABC):
    """A score: a subclass names it and gives its cost and maths (abstract, so none is silently free)."""

    name: str = ""
    needs: frozenset[str] = frozenset()  # MAPS, PROBE
    fitted: bool = False  # it needs a probe the stage trained: not for a gate named by arguments alone

    def reads(self, scorer) -> tuple[str, ...]:
        """The scores or features computed before it, which its maths read from `Evidence.values`."""
        return ()

    def refusal(self, scorer) -> str | None:
        """Why `scorer` cannot compute it (what it needs is missing), or None."""
        if MAPS in self.needs and scorer.disagree is None:
            return f"the {self.name!r} score needs its two maps (k=1 and k=max)"
        if PROBE in self.needs and scorer.probe is None:
            return f"the {self.name!r} score needs a probe fitted on dev items (the selective stage fits one)"
        return None

    @abstractmethod
    def cost(self, work: Work) -> int:
        """The multiply-adds it adds to the handoff of one prompt (the handoff's own first step not counted again)."""

    @abstractmethod
    def score(self, evidence: Evidence) -> torch.Tensor:
        """(B,): each context's score, higher = less trusted."""


def next_token_entropy(logprobs: torch.Tensor) -> torch.Tensor:
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


class Entropy(Score):
    """H(p_target(. | mapped)): the target unsure of its next token after the handoff; one pass over the logits."""

    name = "entropy"

    def cost(self, work: Work) -> int:
        return work.target_config.vocab_size

    def score(self, evidence: Evidence) -> torch.Tensor:
        return next_token_entropy(evidence.logprobs)


class KL(Score):
    """KL(p_source || p_target(. | mapped)): the target after the handoff far from what the source predicts; the
    source's step on c[n-1] after its own cache (shared with the handoff's prefill) and its logits."""

    name = "kl"

    def cost(self, work: Work) -> int:
        source, prefix = work.source_config, work.length - 1
        return (linear_macs_per_token(source) + attention_macs(source, prefix, work.length) + logits_macs(source)
                + source.vocab_size)

    def score(self, evidence: Evidence) -> torch.Tensor:
        first, target = evidence.first, evidence.logprobs
        source = evidence.scorer.source_alone.first_step(first.prefixes, prefilled=first.source).logprobs  # (B, V_s)
        return kl(source.to(target.device), target)


class Disagree(Score):
    """JS(p_target(. | map a), p_target(. | map b)): two maps (k=1 and k=max) disagreeing on the first step; a second
    map over the prefix (the source's prefill shared) and a second target step."""

    name = "disagree"
    needs = frozenset({MAPS})

    def cost(self, work: Work) -> int:
        target, prefix = work.target_config, work.length - 1
        return (prefix * work.second_map_macs + linear_macs_per_token(target)
                + attention_macs(target, prefix, work.length) + logits_macs(target))

    def score(self, evidence: Evidence) -> torch.Tensor:
        first, scorer = evidence.first, evidence.scorer
        first_map, second_map = (evidence.logprobs if handoff is scorer.handoff else
                                 handoff.first_step(first.prefixes, prefilled=first.source).logprobs
                                 for handoff in scorer.disagree)  # (B, V) each
        return jensen_shannon(first_map, second_map.to(first_map.device))


class Probe(Score):
    """A logistic regression's logit for "the map changes the decision" from the first step's features (the other
    scores, the target's top-1 probability, the caches' norm ratios), fitted on dev items only (`kv.gate.Probe`);
    costs its features', a pass over the logits (top-1), one over both caches (norms) and its dot product."""

    name = "probe"
    needs = frozenset({PROBE})
    fitted = True

    def reads(self, scorer) -> tuple[str, ...]:
        return tuple(scorer.probe.features)

    def cost(self, work: Work) -> int:
        prefix = work.length - 1
        norms = prefix * sum(geometry["layers"] * geometry["kv_heads"] * geometry["head_dim"] * 2
                             for geometry in (kv_geometry(work.source_config), kv_geometry(work.target_config)))
        return (sum(work.scores[feature].cost(work) for feature in work.features if feature in work.scores)
                + work.target_config.vocab_size + norms + len(work.features))

    def score(self, evidence: Evidence) -> torch.Tensor:
        return evidence.scorer.probe(evidence.values)


class Feature(Score):
    """A probe's input that is no gate score; its cost is counted in the probe's, once for every feature."""

    def cost(self, work: Work) -> int:
        return 0


class Top1(Feature):
    """The target's top-1 probability after the handoff."""

    name = "top1"

    def score(self, evidence: Evidence) -> torch.Tensor:
        return evidence.logprobs.max(-1).values.exp()


class NormRatio(Feature):
    """The log-ratio of the mapped cache's mean key (side 0) or value (side 1) norm to the source cache's."""

    def __init__(self, name: str, side: int):
        self.name, self.side = name, side

    def score(self, evidence: Evidence) -> torch.Tensor:
        mapped, source = (norms[self.side] for norms in evidence.norms)
        return (mapped / source).log()


def register(*scores: Score) -> dict[str, Score]:
    return entries.register(Score, "scores", scores)


SCORES = register(Entropy(), KL(), Disagree(), Probe())
INPUTS = register(Top1(), NormRatio("key_norm", 0), NormRatio("value_norm", 1))  # the probe's inputs that are no score
FITTED_SCORES = tuple(name for name, score in SCORES.items() if score.fitted)  # not for a gate named by arguments alone
FEATURES = (*(name for name in SCORES if name not in FITTED_SCORES), *INPUTS)  # a probe's inputs (first step only)


def refusal(names: Sequence[str], scorer, scores: Mapping[str, Score]) -> str | None:
    """Why `scorer` cannot compute `names` from `scores` and the probe's inputs (one unknown, or needs missing)."""
    known = {**scores, **INPUTS}
    for name in names:
        if name not in known:
            return f"unknown score {name!r} (known: {', '.join(scores)})"
        reason = known[name].refusal(scorer) or refusal(known[name].reads(scorer), scorer, scores)
        if reason:
            return reason
    return None


def score_macs(name: str, source_config, target_config, second_map_macs: int, length: int,
               features: Sequence[str] = FEATURES, scores: Mapping[str, Score] = SCORES) -> int:
    """Multiply-adds the score `name` adds to the handoff of a prompt of `length` tokens (`Work`'s fields)."""
    if name not in scores:
        raise ValueError(f"unknown score {name!r} (known: {', '.join(scores)})")
    return scores[name].cost(Work(source_config, target_config, second_map_macs, length, tuple(features), scores))
