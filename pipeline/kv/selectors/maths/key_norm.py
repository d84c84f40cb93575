"""The maths of `key_norm` (`kv/selectors/key_norm.py`): each token's mapped key norms, relative to its row's mean
per layer, summed over the layers read."""
from __future__ import annotations

from pipeline.kv.kvcache import real_slots
from pipeline.kv.selectors import key_norm
from pipeline.kv.selectors.maths.base import Evidence, SelectorMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class KeyNormMaths(SelectorMaths):
    declaration = key_norm.SELECTOR

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        lengths = evidence.lengths
        real = real_slots(lengths, evidence.prefix_ids.shape[1])  # (B, P)
        total = 0
        for keys, _ in evidence.mapped[: argument or len(evidence.mapped)]:
            norms = keys.float().cpu().pow(2).sum(dim=(1, 3))  # (B, P)
            mean = (norms * real).sum(dim=1, keepdim=True) / lengths.clamp(min=1)[:, None]  # (B, 1)
            total = total + norms / mean.clamp_min(1e-12)
        return total


MATHS = KeyNormMaths()
