"""`recency`: the prompt's last tokens, a chunked prefill of its end over the mapped rest; free to choose."""
from __future__ import annotations

from pipeline.kv.selectors.base import Selector, Work


class Recency(Selector):
    name = "recency"

    def cost(self, work: Work, argument) -> int:
        return 0


SELECTOR = Recency()
