"""The maths of `source_attention` (`kv/selectors/source_attention.py`): the source's look-ahead scores as they came
from its prefill (`kv.lookahead`); the selector computes nothing more."""
from __future__ import annotations

from pipeline.kv.selectors import source_attention
from pipeline.kv.selectors.maths.base import Evidence, SelectorMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class SourceAttentionMaths(SelectorMaths):
    declaration = source_attention.SELECTOR

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        if evidence.source_scores is None:
            raise ValueError("policy source_attention ranks by the source's look-ahead scores, but the handoff made "
                             "none: repair a mode that hands the source's cache over")
        return evidence.source_scores.float().cpu()  # (B, P)


MATHS = SourceAttentionMaths()
