"""What a gate score is: the one interface every score module fills in.

A score says how little a handed-off request is trusted (higher: less), read off the gated handoff's first step
only (`kv.gate`). Its module (`kv/scores/<name>.py`) says everything the pipeline needs of it and nothing outside
`kv/scores/` lists scores: its name, what it needs besides the first step (`MAPS`: the two maps of `disagree`;
`PROBE`: a probe fitted by the stage), what it reads that is computed before it (the probe: its features), how it
scores, and what the scoring costs in multiply-adds beyond the handoff's own first step (abstract: a score without a
cost cannot be instantiated, so none is silently free). The probe's other inputs (`kv/scores/features.py`) share
the shape; their cost is the probe's.

Shapes: B contexts; a score (B,), computed on the first step's device and kept float64 on the CPU by the scorer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, NamedTuple

from pipeline.store.lazy import lazy

torch = lazy("torch")

MAPS = "maps"  # a need: the scorer's two mapped handoffs (k=1 and k=max)
PROBE = "probe"  # a need: a probe the selective stage fitted on dev items


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


class Work(NamedTuple):
    """What a score's multiply-adds are counted from, for a prompt of `length` tokens."""

    source_config: object
    target_config: object
    second_map_macs: int  # `disagree`'s second map, per token
    length: int
    features: tuple[str, ...]  # the probe's inputs
    scores: Mapping[str, "Score"]  # the registry the probe counts its scores' costs from


class Score(ABC):
    """The interface of a score; a score module defines one subclass and one instance, `SCORE`."""

    name: str = ""
    needs: frozenset[str] = frozenset()  # MAPS, PROBE
    fitted: bool = False  # it needs a probe the stage trained: not for a gate named by arguments alone

    def reads(self, scorer) -> tuple[str, ...]:
        """The scores or features computed before it, which it reads from `Evidence.values`."""
        return ()

    def refusal(self, scorer) -> str | None:
        """Why `scorer` cannot compute it (what it needs is missing), or None."""
        if MAPS in self.needs and scorer.disagree is None:
            return f"the {self.name!r} score needs its two maps (k=1 and k=max)"
        if PROBE in self.needs and scorer.probe is None:
            return f"the {self.name!r} score needs a probe fitted on dev items (the selective stage fits one)"
        return None

    @abstractmethod
    def score(self, evidence: Evidence) -> torch.Tensor:
        """(B,): each context's score, higher = less trusted."""

    @abstractmethod
    def cost(self, work: Work) -> int:
        """The multiply-adds it adds to the handoff of one prompt (the handoff's own first step not counted again)."""
