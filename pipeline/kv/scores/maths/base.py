"""What a gate score's maths is: how the score declared in `kv/scores/<name>.py` is computed from a first step.

Its module (`kv/scores/maths/<name>.py`) names its declaration and scores; the declaration says the rest (name,
needs, what it reads first, cost). The gate's scorer (`kv.gate.Scorer`) is the one reader.

Shapes: B contexts; a score (B,), computed on the first step's device and kept float64 on the CPU by the scorer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property

from pipeline.kv.entries import Maths
from pipeline.kv.scores.base import Score
from pipeline.store.lazy import lazy

torch = lazy("torch")


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


class ScoreMaths(Maths, ABC):
    """The interface of a score's maths; a maths module defines one subclass, naming its declaration
    (`declaration`, the module's `SCORE`), and one instance, `MATHS`."""

    declaration: Score | None = None

    @abstractmethod
    def score(self, evidence: Evidence) -> torch.Tensor:
        """(B,): each context's score, higher = less trusted."""
