"""`source_attention`: the tokens the source's look-ahead attends to most (its attention from the prefix's last m
tokens, pooled as params' `speculative` section declares: `kv.lookahead`), so the query-aware choice speculative
prefill makes picks which tokens of the mapped cache the target recomputes. The scores come from the forward that
prefills the source's cache; they cost the last m queries' q.k over the prefix in each source layer read."""
from __future__ import annotations

from pipeline.kv.selectors.base import Selector, Work


class SourceAttention(Selector):
    name = "source_attention"
    reads_source = True

    def cost(self, work: Work, argument) -> int:
        return work.source_scores


SELECTOR = SourceAttention()
