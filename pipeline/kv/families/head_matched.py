"""The `head_matched` family: like `linear`, but target head h reads only source head h of the k chosen layers
(a restricted map, kv_heads_s times fewer parameters); it needs equal KV head counts.

    weight (H, k*D_s, D), bias (H, D);  out[b, h, t] = inputs[b, h, t] @ weight[h] + bias[h]

Fitted in closed form, one ridge solve per head (the heads read different inputs).
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry, Solved, columns
from pipeline.store.lazy import lazy

torch = lazy("torch")


class HeadMatched(Family):
    name = "head_matched"
    tensor_names = ("weight", "bias")
    name_fields = ("k", "lambda")
    fitting = "closed_form"

    def requirement(self, source: dict, target: dict) -> str | None:
        if source["kv_heads"] == target["kv_heads"]:
            return None
        return (f"head_matched needs equal KV head counts, but the source has {source['kv_heads']} and the target "
                f"{target['kv_heads']}")

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        return (geometry.heads_t, k * geometry.dim_s, geometry.dim_t), (geometry.heads_t, geometry.dim_t)

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


FAMILY = HeadMatched()
