"""What a gate score is: the one interface every score module fills in, its declaration.

A score says how little a handed-off request is trusted (higher: less), read off the gated handoff's first step
only (`kv.gate`). It is two modules, and nothing outside `kv/scores/` lists scores:

    kv/scores/<name>.py        its declaration: its name, what it needs besides the first step (`MAPS`: the two maps
                               of `disagree`; `PROBE`: a probe fitted by the stage), what it reads that is computed
                               before it (the probe: its features), and what the scoring costs in multiply-adds
                               beyond the handoff's own first step (abstract: a score without a cost cannot be
                               instantiated, so none is silently free)
    kv/scores/maths/<name>.py  its maths: how it scores (torch), `maths.base.ScoreMaths`

The probe's other inputs (`kv/scores/features.py`, their maths `kv/scores/maths/features.py`) share the shape; their
cost is the probe's. The params' checks, the FLOP model and the report read the declarations alone; only the gate
(`kv.gate`) imports the maths.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping, NamedTuple

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


class Score(ABC):
    """The declaration of a score; a score module defines one subclass and one instance, `SCORE`."""

    name: str = ""
    needs: frozenset[str] = frozenset()  # MAPS, PROBE
    fitted: bool = False  # it needs a probe the stage trained: not for a gate named by arguments alone

    def reads(self, scorer) -> tuple[str, ...]:
        """The scores or features computed before it, which its maths read from `maths.base.Evidence.values`."""
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
