"""`deviation`: the tokens whose mapped keys/values differ most from the target's exact ones at layer n-1 (layer 0
when the setting recomputes no layer: the embedding's K/V projections of every token, the selection's cost)."""
from __future__ import annotations

from pipeline.kv.selectors.base import EXACT, Evidence, Selector, Work
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Deviation(Selector):
    name = "deviation"
    needs = frozenset({EXACT})

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        return deviation(evidence.exact, evidence.mapped[evidence.exact_index])

    def cost(self, work: Work, argument) -> int:
        return 0 if work.exact_layers else work.prefix * work.kv_projection_per_token


def deviation(exact: tuple, mapped: tuple) -> torch.Tensor:
    """(B, P): per token, sum over keys and values of |exact - mapped|^2 over heads and dims, each relative to
    the mean |exact|^2 of its kind (so keys and values weigh alike)."""
    total = 0
    for reference, other in zip(exact, mapped):
        reference = reference.float().cpu()
        error = (reference - other.float().cpu()).pow(2).sum(dim=(1, 3))  # (B, P)
        total = total + error / reference.pow(2).sum(dim=(1, 3)).mean(dim=1, keepdim=True).clamp_min(1e-12)
    return total


SELECTOR = Deviation()
