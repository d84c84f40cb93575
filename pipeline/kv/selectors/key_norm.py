"""`key_norm`: the tokens whose mapped keys are largest. A key's norm scales every logit on it, so where the map
errs, an outsized mapped key pulls the target's attention the most: recomputing those first bounds the damage. Per
token, sum over layers of |key|^2 over heads and dims, each relative to the mean over the row's tokens in that layer
(so layers weigh alike). Reads the mapped cache only: no target forward.

`key_norm@N`: the first N layers only (the cheaper read; the early layers are the ones a map fits worst).
"""
from __future__ import annotations

from pipeline.kv.selectors.base import Selector, Work


class KeyNorm(Selector):
    name = "key_norm"
    parameter = "the first N layers only"

    def read(self, text: str) -> int:
        return int(text)

    def refusal(self, argument, layers: int | None) -> str | None:
        if argument is not None and argument < 1:
            return f"policy key_norm@{argument}: the layers read are a count >= 1"
        if argument is not None and layers is not None and argument > layers:
            return f"policy key_norm@{argument}: the target has only {layers} layers"
        return None

    def cost(self, work: Work, argument) -> int:
        return work.prefix * work.key_width * (argument or work.layers)  # one square per key element read


SELECTOR = KeyNorm()
