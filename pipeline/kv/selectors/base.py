"""What a repair's token selector is: the one interface every selector module fills in.

A selector (a *policy* in a repair setting's string form, `tokens:RHO:POLICY`) says which prefix tokens the target
recomputes first: it scores every token of every row, and `kv.repair` recomputes the round(RHO x (P - sink))
highest-scored tokens after the sink. Its module (`kv/selectors/<name>.py`) says everything the pipeline needs of it
and nothing outside `kv/selectors/` lists selectors: its name, what it needs besides the mapped cache (the target's
exact keys/values of one early layer), how it scores tokens, what the scoring costs in multiply-adds (abstract: a
selector without a cost cannot be instantiated, so none is silently free in the budget), and its own parameter if
it takes one (`tokens:RHO:POLICY@VALUE`; `@` since lm-eval splits its model args at `,` and `=`).

Shapes: B rows of a right-padded prefix of P slots; scores (B, P), higher is recomputed first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

from pipeline.store.lazy import lazy

torch = lazy("torch")

EXACT = "exact"  # a need: the target's exact keys/values of layer max(exact_layers - 1, 0) over the prefix


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
    count: object  # kv.repair.RepairCount: a selector that runs the target adds its work
    devices: list | None  # where each cache layer goes (kv.kvcache.layer_devices), None for the target's device


class Work(NamedTuple):
    """What a selection's multiply-adds are counted from, for a target and a prefix (`kv.flops` fills it in)."""

    prefix: int  # P, the prefix tokens
    layers: int  # the target's decoder layers
    exact_layers: int  # layers the setting recomputes exactly (their keys and values are then already there)
    linear_per_token: int  # every linear layer of the target, one token
    kv_projection_per_token: int  # one layer's K and V projections, one token
    read_per_key: int  # one layer's q.k and weighted value for one query over one key (every query head)
    key_width: int  # kv_heads x head_dim: one layer's key of one token


class Selector(ABC):
    """The interface of a selector; a selector module defines one subclass and one instance, `SELECTOR`."""

    name: str = ""
    needs: frozenset[str] = frozenset()  # EXACT where it reads the target's exact early-layer keys/values
    parameter: str | None = None  # what its `@VALUE` means (None: it takes none)

    def read(self, text: str) -> int | float:
        """Its parameter's value from the text after `@`; ValueError when malformed or when it takes none."""
        raise ValueError(f"policy {self.name} takes no parameter")

    def refusal(self, argument, layers: int | None) -> str | None:
        """Why `argument` cannot be used on a target of `layers` layers (None: any target), or None; a selector
        without a parameter refuses every argument but None."""
        return None if argument is None else f"policy {self.name} takes no parameter"

    @abstractmethod
    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        """(B, P): each prefix slot's score; only slots sink..length-1 of a row are ever chosen."""

    @abstractmethod
    def cost(self, work: Work, argument) -> int:
        """The multiply-adds of scoring one prefix, as `kv.flops` counts the rest of the repair."""
