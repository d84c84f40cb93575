"""What a selector's maths is: how the policy declared in `kv/selectors/<name>.py` scores a prefix's tokens.

Its module (`kv/selectors/maths/<name>.py`) names its declaration and scores; the declaration says the rest (name,
needs, parameter, cost). The repair's run (`kv.recompute`) is the one reader.

Shapes: B rows of a right-padded prefix of P slots; scores (B, P), higher is recomputed first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pipeline.kv.entries import Maths
from pipeline.kv.selectors.base import Selector
from pipeline.store.lazy import lazy

torch = lazy("torch")


@dataclass
class Evidence:
    """What a selector may read when it scores a prefix."""

    target: object  # the target model
    layers: list  # the cache as repaired so far (exact layers, sink), per layer (B, H, P, D), rotated, target dtype
    mapped: list  # the cache as it was handed to the repair
    exact: tuple | None  # (keys, values) (B, H, P, D) of the target's layer `exact_index`, when the selector needs it
    exact_index: int
    prefix_ids: torch.Tensor  # (B, P)
    lengths: torch.Tensor  # (B,) real lengths of right-padded rows, on the CPU
    count: object  # kv.recompute.RepairCount: a selector that runs the target adds its work
    devices: list | None  # where each cache layer goes (kv.kvcache.layer_devices), None for the target's device
    source_scores: torch.Tensor | None  # (B, P) the source's look-ahead scores, where the policy reads them


class SelectorMaths(Maths, ABC):
    """The interface of a selector's maths; a maths module defines one subclass, naming its declaration
    (`declaration`, the module's `SELECTOR`), and one instance, `MATHS`."""

    declaration: Selector | None = None

    @abstractmethod
    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        """(B, P): each prefix slot's score; only slots sink..length-1 of a row are ever chosen."""
