"""Selective handoff: a per-request confidence score computed without the target's prefill, and the gate that
falls back to the target's own prefill where the mapped cache is not trusted.

Every score reads the handoff's first step only (PROTOCOL.md, "Handoff"; the step the handoff runs anyway to
give the first token), so its cost is that step's work plus at most one extra token of a model:

    source body:  c[0] ... c[n-2]                 -> cache                (the handoff's own prefill)
    source step:  c[n-1] after its own cache       -> p_source(. | c)      (`kl` only: one source token + logits)
    map:          source cache -> target cache(s)                          (`disagree`: both of its maps)
    target step:  c[n-1] after the mapped cache    -> p_target(. | mapped) (the handoff's own first step)

Scores, higher = less trusted:

    entropy   H(p_target(. | mapped)): the target unsure of its next token after the handoff
    kl        KL(p_source || p_target(. | mapped)): the target after the handoff far from what the source predicts
    disagree  JS(p_target(. | map a), p_target(. | map b)): two maps (k=1 and k=max) disagree on the first step

A context of one token has an empty prefix: nothing is handed off, the handoff is the oracle, its score -inf.
The `Gate` falls back where score > threshold: threshold +inf is the ungated handoff, -inf the oracle everywhere.
"""
from __future__ import annotations

from typing import Sequence

from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.handoff import Handoff, padded_prefixes
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")

SCORES = ("entropy", "kl", "disagree")
REFERENCES = ("oracle", "random")  # the upper bound and the null: curves of the stage, not request-time scores


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


def score_macs(name: str, source_config, target_config, second_map_macs: int, length: int) -> int:
    """Multiply-adds a score adds to the handoff of a prompt of `length` tokens (the handoff's own first step
    is not counted again): `entropy` one per logit; `kl` the source's step on c[n-1] with its logits;
    `disagree` a second map (`second_map_macs` per token) over the prefix and a second target step."""
    prefix = length - 1
    if name == "entropy":
        return target_config.vocab_size
    if name == "kl":
        return (linear_macs_per_token(source_config) + attention_macs(source_config, prefix, length)
                + logits_macs(source_config) + source_config.vocab_size)
    if name == "disagree":
        return (prefix * second_map_macs + linear_macs_per_token(target_config)
                + attention_macs(target_config, prefix, length) + logits_macs(target_config))
    raise ValueError(f"unknown score {name!r} (known: {', '.join(SCORES)})")


class Scorer:
    """The scores of requests handed off through `handoff` (a source mode), from its first step only.

    `disagree`: the two mapped handoffs (k=1 and k=max) whose first steps the `disagree` score compares; they
    share `handoff`'s source prefill. No score reads the target's prefill of the prompt (tests make it fail)."""

    def __init__(self, handoff: Handoff, disagree: tuple[Handoff, Handoff] | None = None):
        if handoff.source is None:
            raise ValueError(f"scores read the source's prefill; the {handoff.mode!r} handoff has no source")
        self.handoff, self.disagree = handoff, disagree
        self.source_alone = Handoff(handoff.source)  # the source's own step after its own cache

    def check(self, names: Sequence[str]) -> None:
        for name in names:
            if name not in SCORES:
                raise ValueError(f"unknown score {name!r} (known: {', '.join(SCORES)})")
            if name == "disagree" and self.disagree is None:
                raise ValueError("the 'disagree' score needs its two maps (k=1 and k=max)")

    @no_grad
    def scores(self, contexts: Sequence[Sequence[int]], names: Sequence[str], batch_size: int = 16
               ) -> dict[str, torch.Tensor]:
        """Each named score (N,), float64 on the CPU, of contexts c[0..n-1], `batch_size` contexts a forward."""
        self.check(names)
        out = {name: torch.full((len(contexts),), float("-inf"), dtype=torch.float64) for name in names}
        rows = [row for row, context in enumerate(contexts) if len(context) >= 2]  # the others hand off nothing
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            for name, values in self._batch([contexts[row] for row in chunk], names).items():
                out[name][chunk] = values.double().cpu()
        return out

    def _batch(self, contexts: Sequence[Sequence[int]], names: Sequence[str]) -> dict[str, torch.Tensor]:
        prefixes, lengths, padded = padded_prefixes(contexts)  # (B, P), (B,)
        lengths = lengths if padded else None
        mask = None if lengths is None else (torch.arange(prefixes.shape[1])[None] < lengths[:, None]).long()
        source_layers = self.handoff.source_prefill(prefixes, mask)
        last = torch.tensor([[context[-1]] for context in contexts])  # (B, 1): c[n-1]
        step = lambda handoff: handoff.step_logprobs(  # noqa: E731  (B, V) after `handoff`'s map
            handoff.to_target(source_layers, lengths), last, lengths)[:, -1]
        target = step(self.handoff)
        out = {}
        if "entropy" in names:
            out["entropy"] = entropy(target)
        if "kl" in names:
            source = self.source_alone.step_logprobs(source_layers, last, lengths)[:, -1]  # (B, V_s)
            out["kl"] = kl(source.to(target.device), target)
        if "disagree" in names:
            first, second = (target if handoff is self.handoff else step(handoff) for handoff in self.disagree)
            out["disagree"] = jensen_shannon(first, second.to(first.device))
        return out


class Gate:
    """Per request: fall back to `fallback` (the target's own prefill) where the score exceeds `threshold`."""

    def __init__(self, scorer: Scorer, score: str, threshold: float, fallback: Handoff):
        scorer.check([score])
        if fallback.mode != "oracle":
            raise ValueError(f"a gate falls back to the target's own prefill (oracle), not {fallback.mode!r}")
        self.scorer, self.score, self.threshold, self.fallback = scorer, score, float(threshold), fallback

    def route(self, contexts: Sequence[Sequence[int]], batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (N,) and whether each request falls back (N,) bool."""
        scores = self.scorer.scores(contexts, [self.score], batch_size)[self.score]
        return scores, scores > self.threshold
