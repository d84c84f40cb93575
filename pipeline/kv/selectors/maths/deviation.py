"""The maths of `deviation` (`kv/selectors/deviation.py`): how far the mapped keys/values of one layer are from the
target's exact ones."""
from __future__ import annotations

from pipeline.kv.selectors import deviation
from pipeline.kv.selectors.maths.base import Evidence, SelectorMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class DeviationMaths(SelectorMaths):
    declaration = deviation.SELECTOR

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        return relative_deviation(evidence.exact, evidence.mapped[evidence.exact_index])


def relative_deviation(exact: tuple, mapped: tuple) -> torch.Tensor:
    """(B, P): per token, sum over keys and values of |exact - mapped|^2 over heads and dims, each relative to
    the mean |exact|^2 of its kind (so keys and values weigh alike)."""
    total = 0
    for reference, other in zip(exact, mapped):
        reference = reference.float().cpu()
        error = (reference - other.float().cpu()).pow(2).sum(dim=(1, 3))  # (B, P)
        total = total + error / reference.pow(2).sum(dim=(1, 3)).mean(dim=1, keepdim=True).clamp_min(1e-12)
    return total


MATHS = DeviationMaths()
