"""What a repair's token selector is: the one interface every selector module fills in, its declaration.

A selector (a *policy* in a repair setting's string form, `tokens:RHO:POLICY`) says which prefix tokens the target
recomputes first: it scores every token of every row, and the repair (`kv.recompute`) recomputes the
round(RHO x (P - sink)) highest-scored tokens after the sink. It is two modules, and nothing outside `kv/selectors/`
lists selectors:

    kv/selectors/<name>.py        its declaration: its name, what it needs besides the mapped cache (the target's
                                  exact keys/values of one early layer), what its scoring costs in multiply-adds
                                  (abstract: a selector without a cost cannot be instantiated, so none is silently
                                  free in the budget), and its own parameter if it takes one
                                  (`tokens:RHO:POLICY@VALUE`; `@` since lm-eval splits its model args at `,` and `=`)
    kv/selectors/maths/<name>.py  its maths: how it scores tokens (torch), `maths.base.SelectorMaths`

The setting grammar (`kv.repair`), the FLOP model and the report read the declarations alone; only the repair's run
imports the maths, so an edit to a selector's scoring reruns the stages that repair and no stage that only names a
setting.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

EXACT = "exact"  # a need: the target's exact keys/values of layer max(exact_layers - 1, 0) over the prefix


class Work(NamedTuple):
    """What a selection's multiply-adds are counted from, for a target and a prefix (`kv.flops` fills it in)."""

    prefix: int  # P, the prefix tokens
    layers: int  # the target's decoder layers
    exact_layers: int  # layers the setting recomputes exactly (their keys and values are then already there)
    linear_per_token: int  # every linear layer of the target, one token
    kv_projection_per_token: int  # one layer's K and V projections, one token
    read_per_key: int  # one layer's q.k and weighted value for one query over one key (every query head)
    key_width: int  # kv_heads x head_dim: one layer's key of one token
    source_scores: int  # the source's look-ahead scores of the prefix (`kv.flops.lookahead_macs`; 0: no source given)


class Selector(ABC):
    """The declaration of a selector; a selector module defines one subclass and one instance, `SELECTOR`."""

    name: str = ""
    needs: frozenset[str] = frozenset()  # EXACT where it reads the target's exact early-layer keys/values
    parameter: str | None = None  # what its `@VALUE` means (None: it takes none)
    reads_source: bool = False  # it ranks by the source's look-ahead scores (`kv.lookahead`, from its prefill)

    def read(self, text: str) -> int | float:
        """Its parameter's value from the text after `@`; ValueError when malformed or when it takes none."""
        raise ValueError(f"policy {self.name} takes no parameter")

    def refusal(self, argument, layers: int | None) -> str | None:
        """Why `argument` cannot be used on a target of `layers` layers (None: any target), or None; a selector
        without a parameter refuses every argument but None."""
        return None if argument is None else f"policy {self.name} takes no parameter"

    @abstractmethod
    def cost(self, work: Work, argument) -> int:
        """The multiply-adds of scoring one prefix, as `kv.flops` counts the rest of the repair."""
