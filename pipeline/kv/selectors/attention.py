"""`attention`: what the prefix's last token c[P-1], read once more over the cache, attends to (summed over layers
and heads; c[P-1] itself scores its weight on its own key). The handoff knows the prefix only, so c[P-1] stands for
the first step's query c[P]. Costs one more step of one token over the prefix, and its scores."""
from __future__ import annotations

from pipeline.kv.selectors.base import Selector, Work


class Attention(Selector):
    name = "attention"

    def cost(self, work: Work, argument) -> int:
        return work.linear_per_token + work.read_per_key * work.layers * (work.prefix + 1) * 3 // 2


SELECTOR = Attention()
