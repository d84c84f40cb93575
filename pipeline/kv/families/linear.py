"""The `linear` family: V0's per-head linear map. Per target layer and kind, each target head's content is
predicted from the k chosen source layers, all source KV heads concatenated, with a bias; k=1 is V0's map.

    weight (H, F, D), bias (H, D);  out[b, h, t] = inputs[b, t] @ weight[h] + bias[h]

Fitted in closed form: all heads read the same inputs, so one ridge solve with every head's columns is exactly
the per-head fit.
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry, Solved, columns, per_head
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Linear(Family):
    name = "linear"
    tensor_names = ("weight", "bias")
    name_fields = ("k", "lambda")
    fitting = "closed_form"
    scale_check = True

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        return (geometry.heads_t, k * geometry.heads_s * geometry.dim_s, geometry.dim_t), (geometry.heads_t,
                                                                                       geometry.dim_t)

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


FAMILY = Linear()
