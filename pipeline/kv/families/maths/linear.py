"""The maths of `linear` (`kv/families/linear.py`): every target head from every source head of the k layers, one
ridge solve for all heads."""
from __future__ import annotations

from pipeline.kv.families import linear
from pipeline.kv.families.maths.base import FamilyMaths, Solved, columns, per_head
from pipeline.store.lazy import lazy

torch = lazy("torch")


class LinearMaths(FamilyMaths):
    declaration = linear.FAMILY

    def project(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("btf,hfd->bhtd", inputs.to(weight.dtype), weight)  # (B, H_t, T, D_t)
        return out + bias[None, :, None, :]

    def solve(self, fit, select, blocks, ridge_lambda, geometry, scale, ridge, device, width) -> Solved:
        inputs = columns(blocks, geometry, device)  # (k*H_s*D_s,)
        own, own_select = fit.select(inputs), select.select(inputs)
        solved = ridge.effective_lambda(own, ridge_lambda, scale)
        weight, bias = ridge.solve(own, solved)  # (F, H*D), (H*D,): all heads, one solve
        return Solved(per_head(weight, bias, geometry), ridge.fitted_residual_ss(own, weight, bias, solved),
                      ridge.residual_ss(own_select, weight, bias), [solved] * geometry.heads_t, inputs.numel() + 1)


MATHS = LinearMaths()
