"""The maths of `low_rank` (`kv/families/low_rank.py`): the ridge map through its top-r principal directions, from
the same moments."""
from __future__ import annotations

from pipeline.kv.families import low_rank
from pipeline.kv.families.maths.base import FamilyMaths, Solved, columns
from pipeline.store.lazy import lazy

torch = lazy("torch")


class LowRankMaths(FamilyMaths):
    declaration = low_rank.FAMILY

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


MATHS = LowRankMaths()
