"""`recency`: the prompt's last tokens, a chunked prefill of its end over the mapped rest; free to choose."""
from __future__ import annotations

from pipeline.kv.selectors.base import Evidence, Selector, Work
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Recency(Selector):
    name = "recency"

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        batch, width = evidence.prefix_ids.shape
        return torch.arange(width, dtype=torch.float32)[None].expand(batch, -1)  # (B, P): later is higher

    def cost(self, work: Work, argument) -> int:
        return 0


SELECTOR = Recency()
