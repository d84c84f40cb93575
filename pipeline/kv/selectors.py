"""The repair's token selectors (a *policy* in `tokens:RHO:POLICY`): each scores every prefix token, and the repair
recomputes the round(RHO x (P - sink)) highest-scored after the sink. Scores (B, P), higher is recomputed first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.kv import entries, projections
from pipeline.kv.kvcache import additive_mask, layers_to_cache, real_slots
from pipeline.store.lazy import lazy

torch = lazy("torch")

EXACT = "exact"  # a need: the target's exact keys/values of layer max(exact_layers - 1, 0) over the prefix


class Work(NamedTuple):
    prefix: int  # P, the prefix tokens
    layers: int  # the target's decoder layers
    exact_layers: int  # layers the setting recomputes exactly (their keys and values are then already there)
    linear_per_token: int  # every linear layer of the target, one token
    kv_projection_per_token: int  # one layer's K and V projections, one token
    read_per_key: int  # one layer's q.k and weighted value for one query over one key (every query head)
    key_width: int  # kv_heads x head_dim: one layer's key of one token
    source_scores: int  # the source's look-ahead scores of the prefix (`kv.flops.lookahead_macs`; 0: no source given)


@dataclass
class Evidence:
    target: object  # the target model
    layers: list  # the cache as repaired so far (exact layers, sink), per layer (B, H, P, D), rotated, target dtype
    mapped: list  # the cache as it was handed to the repair
    exact: tuple | None  # (keys, values) (B, H, P, D) of the target's layer `exact_index`, where needed
    exact_index: int
    prefix_ids: torch.Tensor  # (B, P)
    lengths: torch.Tensor  # (B,) real lengths of right-padded rows, on the CPU
    count: object  # kv.recompute.RepairCount: a selector that runs the target adds its work
    devices: list | None  # where each cache layer goes (kv.kvcache.layer_devices), None for the target's device
    source_scores: torch.Tensor | None  # (B, P) the source's look-ahead scores, where the policy reads them


class Selector(ABC):
    """A subclass names it and gives its cost and scores (abstract: none is silently free in the budget); its
    parameter comes after `@` (`tokens:RHO:POLICY@VALUE`: lm-eval splits its model args at `,` and `=`)."""

    name: str = ""
    needs: frozenset[str] = frozenset()  # EXACT where it reads the target's exact early-layer keys/values
    parameter: str | None = None  # what its `@VALUE` means (None: it takes none)
    reads_source: bool = False  # it ranks by the source's look-ahead scores

    def read(self, text: str) -> int | float:
        """Its parameter's value from the text after `@`; ValueError when malformed or it takes none."""
        raise ValueError(f"policy {self.name} takes no parameter")

    def refusal(self, argument, layers: int | None) -> str | None:
        """Why `argument` cannot be used on a target of `layers` layers (None: any target), or None."""
        return None if argument is None else f"policy {self.name} takes no parameter"

    @abstractmethod
    def cost(self, work: Work, argument) -> int:
        """The multiply-adds of scoring one prefix."""

    @abstractmethod
    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        """(B, P): each prefix slot's score; only slots sink..length-1 of a row are ever chosen."""


class Deviation(Selector):
    """The tokens whose mapped keys/values differ most from the target's exact ones at layer n-1 (layer 0 when the
    setting recomputes no layer: the selection's cost)."""

    name = "deviation"
    needs = frozenset({EXACT})

    def cost(self, work: Work, argument) -> int:
        return 0 if work.exact_layers else work.prefix * work.kv_projection_per_token

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        """Per token, sum over keys and values of |exact - mapped|^2 over heads and dims, each relative to the mean
        |exact|^2 of its kind (so keys and values weigh alike)."""
        total = 0
        for reference, other in zip(evidence.exact, evidence.mapped[evidence.exact_index]):
            reference = reference.float().cpu()
            error = (reference - other.float().cpu()).pow(2).sum(dim=(1, 3))  # (B, P)
            total = total + error / reference.pow(2).sum(dim=(1, 3)).mean(dim=1, keepdim=True).clamp_min(1e-12)
        return total


class Attention(Selector):
    """What the prefix's last token c[P-1], read once more over the cache, attends to (summed over layers and heads):
    the handoff knows the prefix only, so c[P-1] stands for the first step's query c[P]."""

    name = "attention"

    def cost(self, work: Work, argument) -> int:
        return work.linear_per_token + work.read_per_key * work.layers * (work.prefix + 1) * 3 // 2

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        target, (batch, width) = evidence.target, evidence.prefix_ids.shape
        last = (evidence.lengths - 1).clamp(min=0)  # (B,)
        tokens = evidence.prefix_ids.cpu().gather(1, last[:, None])  # (B, 1)
        allowed = torch.cat([real_slots(last, width), torch.ones(batch, 1, dtype=torch.bool)], dim=1)  # (B, P + 1)
        dtype = target.dtype
        mask = additive_mask(allowed[:, None, None], dtype)  # (B, 1, 1, P + 1)
        cache = layers_to_cache(evidence.layers, target.config, dtype, evidence.devices or target.device)
        with projections.attention_inputs(target) as captured:
            target.model(input_ids=tokens.to(target.device), cache=cache, use_cache=True,
                         attention_mask=mask.to(target.device), position_ids=last[:, None].to(target.device))
        evidence.count.forwards += 1
        evidence.count.token_layers += batch * target.config.num_hidden_layers
        scores = torch.zeros(batch, width + 1)
        for index, (module, hidden, (cos, sin)) in captured.items():
            query = projections.rotate(projections.queries(module, hidden), cos, sin)  # (B, Hq, 1, D)
            keys = cache.layers[index].keys  # (B, H, P + 1, D)
            keys = keys.repeat_interleave(module.num_key_value_groups, dim=1).to(query.device)  # (B, Hq, P + 1, D)
            logits = (query.float() @ keys.float().transpose(2, 3)) * module.scaling  # (B, Hq, 1, P + 1)
            logits = logits + mask.float().to(logits.device)
            scores += logits.softmax(dim=-1).sum(dim=(1, 2)).cpu()  # (B, P + 1)
        own = scores[:, width]  # the last token's weight on its fresh key
        scores = scores[:, :width].clone()
        scores[torch.arange(batch), last] = own
        return scores


class Recency(Selector):
    """The prompt's last tokens: a chunked prefill of its end over the mapped rest."""

    name = "recency"

    def cost(self, work: Work, argument) -> int:
        return 0

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        batch, width = evidence.prefix_ids.shape
        return torch.arange(width, dtype=torch.float32)[None].expand(batch, -1)  # (B, P): later is higher


class KeyNorm(Selector):
    """The tokens whose mapped keys are largest: where the map errs, an outsized key pulls attention the most. Per
    token, the sum over layers of |key|^2, each relative to the row's mean in that layer (so layers weigh alike).
    `key_norm@N` reads the first N layers only (the early layers are the ones a map fits worst)."""

    name = "key_norm"
    parameter = "the first N layers only"

    def read(self, text: str) -> int:
        return int(text)

    def refusal(self, argument, layers: int | None) -> str | None:
        if argument is not None and argument < 1:
            return f"policy key_norm@{argument}: the layers read are a count >= 1"
        if argument is not None and layers is not None and argument > layers:
            return f"policy key_norm@{argument}: the target has only {layers} layers"
        return None

    def cost(self, work: Work, argument) -> int:
        return work.prefix * work.key_width * (argument or work.layers)  # one square per key element read

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        lengths = evidence.lengths
        real = real_slots(lengths, evidence.prefix_ids.shape[1])  # (B, P)
        total = 0
        for keys, _ in evidence.mapped[: argument or len(evidence.mapped)]:
            norms = keys.float().cpu().pow(2).sum(dim=(1, 3))  # (B, P)
            mean = (norms * real).sum(dim=1, keepdim=True) / lengths.clamp(min=1)[:, None]  # (B, 1)
            total = total + norms / mean.clamp_min(1e-12)
        return total


class SourceAttention(Selector):
    """The tokens the source's look-ahead attends to most (`kv.lookahead`): speculative prefill's choice."""

    name = "source_attention"
    reads_source = True

    def cost(self, work: Work, argument) -> int:
        return work.source_scores

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        return evidence.source_scores.float().cpu()  # (B, P)


SELECTORS = entries.register(Selector, "policies", (Deviation(), Attention(), Recency(), KeyNorm(), SourceAttention()))
POLICIES = tuple(SELECTORS)
