"""The route words: how one request was served. A way is the handoff's own mode (REPAIRED under a repair setting),
EMPTY_PREFIX (a one-token context hands nothing off) or CACHED (answered from kv-transfer's request cache, keeping its
`first` way). No way is `refused`: a request the handoff cannot serve stops the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeline.kv.modes import OWN_MODES

EMPTY_PREFIX, REPAIRED, CACHED = "empty_prefix", "repaired", "cached"
SENTENCES = {EMPTY_PREFIX: "nothing handed off (a one-token prompt)"}  # the ways a reader meets in generate's table


@dataclass(frozen=True)
class Route:
    """How one request was served; `first`: for a CACHED request, the way that first served it."""

    way: str
    first: str | None = None

    def from_cache(self) -> "Route":
        """This route for a request answered later from the cache that stored it."""
        return Route(CACHED, self.first or self.way)


def served_by(mode: str, repaired: bool) -> str:
    """The way of a request the handoff serves itself: its mode, or REPAIRED under a repair setting."""
    return REPAIRED if repaired else mode


def ways(mode: str, repaired: bool) -> list[str]:
    """Every way a handoff of `mode` can send a request, in the order counts list them."""
    return [served_by(mode, repaired)] + ([] if mode in OWN_MODES else [EMPTY_PREFIX])


def way(mode: str, repaired: bool, context: Sequence[int]) -> str:
    """The way of one context c[0..n-1]: EMPTY_PREFIX where a mode that hands a cache off has nothing to hand (a
    one-token context: its prefix c[0..n-2] is empty), else the handoff's own."""
    if mode not in OWN_MODES and len(context) < 2:
        return EMPTY_PREFIX
    return served_by(mode, repaired)
