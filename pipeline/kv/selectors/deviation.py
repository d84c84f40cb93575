"""`deviation`: the tokens whose mapped keys/values differ most from the target's exact ones at layer n-1 (layer 0
when the setting recomputes no layer: the embedding's K/V projections of every token, the selection's cost)."""
from __future__ import annotations

from pipeline.kv.selectors.base import EXACT, Selector, Work


class Deviation(Selector):
    name = "deviation"
    needs = frozenset({EXACT})

    def cost(self, work: Work, argument) -> int:
        return 0 if work.exact_layers else work.prefix * work.kv_projection_per_token


SELECTOR = Deviation()
