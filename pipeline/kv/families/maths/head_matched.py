"""The maths of `head_matched` (`kv/families/head_matched.py`): each target head from its own source head, one ridge
solve per head."""
from __future__ import annotations

from pipeline.kv.families import head_matched
from pipeline.kv.families.maths.base import FamilyMaths, Solved, columns
from pipeline.store.lazy import lazy

torch = lazy("torch")


class HeadMatchedMaths(FamilyMaths):
    declaration = head_matched.FAMILY

    def inputs(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)  # (B, H, T, k*D_s): own head only

    def project(self, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("bhtf,hfd->bhtd", inputs.to(weight.dtype), weight)  # one batched matmul for all heads
        return out + bias[None, :, None, :]

    def solve(self, fit, select, blocks, ridge_lambda, geometry, scale, ridge, device, width) -> Solved:
        weights, biases, sse_fit, sse_select, lambdas = [], [], [], [], []
        for head in range(geometry.heads_t):
            inputs = columns(blocks, geometry, device, head)  # (k*D_s,)
            outputs = torch.arange(head * geometry.dim_t, (head + 1) * geometry.dim_t, device=device)
            own = fit.select(inputs, outputs)
            lambdas.append(ridge.effective_lambda(own, ridge_lambda, scale))
            weight, bias = ridge.solve(own, lambdas[-1])  # (k*D_s, D), (D,)
            sse_fit.append(ridge.fitted_residual_ss(own, weight, bias, lambdas[-1]))
            sse_select.append(ridge.residual_ss(select.select(inputs, outputs), weight, bias))
            weights.append(weight)
            biases.append(bias)
        return Solved((torch.stack(weights), torch.stack(biases)), torch.cat(sse_fit), torch.cat(sse_select),
                      lambdas, inputs.numel() + 1)


MATHS = HeadMatchedMaths()
