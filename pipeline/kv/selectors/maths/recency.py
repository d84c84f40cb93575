"""The maths of `recency` (`kv/selectors/recency.py`): later slots score higher."""
from __future__ import annotations

from pipeline.kv.selectors import recency
from pipeline.kv.selectors.maths.base import Evidence, SelectorMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class RecencyMaths(SelectorMaths):
    declaration = recency.SELECTOR

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        batch, width = evidence.prefix_ids.shape
        return torch.arange(width, dtype=torch.float32)[None].expand(batch, -1)  # (B, P): later is higher


MATHS = RecencyMaths()
