"""The `low_rank` family: a reduced-rank ridge map. Per target layer and kind, the ridge solution of `linear`
projected on the top-r principal directions of its fitted values, stored as two factors:

    down (F, r), up (H, r, D), bias (H, D);  out[b, h, t] = (inputs[b, t] @ down) @ up[h] + bias[h]

r (F + H*D) multiply-adds per token and kind instead of F*H*D. Closed form from the same moments: with W the
ridge weight (F, H*D) and C the inputs' centered Gram (F, F), the fitted values' scatter is W^T C W (H*D, H*D);
V (H*D, r) its top-r eigenvectors; W_r = W V V^T, so down = W V and up = V^T; the bias keeps the fitted means
(b_r = mean_y - mean_x W_r). The rank is `fit.low_rank.ranks`; at r >= H*D it is `linear` exactly.
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry, Solved, columns
from pipeline.store.lazy import lazy

torch = lazy("torch")


class LowRank(Family):
    name = "low_rank"
    tensor_names = ("down", "up", "bias")
    name_fields = ("k", "rank", "lambda")
    width_name = "rank"
    width_param = "fit.low_rank.ranks"  # params.yaml's key for its inner size(s)
    fitting = "closed_form"

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        if not width:
            raise ValueError("the low_rank family's size needs its rank")
        return ((k * geometry.heads_s * geometry.dim_s, width), (geometry.heads_t, width, geometry.dim_t),
                (geometry.heads_t, geometry.dim_t))

    def width(self, tensors: tuple) -> int | None:
        return tensors[0].shape[1]

    def project(self, inputs: torch.Tensor, down: torch.Tensor, up: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        reduced = inputs.to(down.dtype) @ down  # (B, T, r)
        out = torch.einsum("btr,hrd->bhtd", reduced, up)  # (B, H_t, T, D_t)
        return out + bias[None, :, None, :]

    def solve(self, fit, select, blocks, ridge_lambda, geometry, scale, ridge, device, width) -> Solved:
        inputs = columns(blocks, geometry, device)  # (F,)
        own, own_select = fit.select(inputs), select.select(inputs)
        solved = ridge.effective_lambda(own, ridge_lambda, scale)
        weight, bias = ridge.solve(own, solved)  # (F, H*D), (H*D,)
        covariance, mean_x = ridge.input_scatter(own)  # (F, F), (F,)
        scatter = weight.T @ covariance @ weight  # (H*D, H*D): the fitted values' scatter
        _, vectors = torch.linalg.eigh(scatter)  # ascending eigenvalues
        top = vectors[:, -width:].flip(-1)  # (H*D, r): the r largest first
        down, up = weight @ top, top.T  # (F, r), (r, H*D)
        reduced = down @ up  # (F, H*D): W V V^T
        bias = bias + mean_x @ (weight - reduced)  # the fitted means kept: mean_y - mean_x W_r
        up = up.reshape(width, geometry.heads_t, geometry.dim_t).permute(1, 0, 2)  # (H, r, D)
        outputs = geometry.heads_t * geometry.dim_t
        return Solved((down, up, bias.reshape(geometry.heads_t, geometry.dim_t)),
                      ridge.residual_ss(own, reduced, bias), ridge.residual_ss(own_select, reduced, bias),
                      [solved] * geometry.heads_t, width * (inputs.numel() + outputs) / outputs + 1)


FAMILY = LowRank()
