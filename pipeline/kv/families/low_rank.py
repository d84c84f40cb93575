"""The `low_rank` family: a reduced-rank ridge map. Per target layer and kind, the ridge solution of `linear`
projected on the top-r principal directions of its fitted values, stored as two factors:

    down (F, r), up (H, r, D), bias (H, D);  out[b, h, t] = (inputs[b, t] @ down) @ up[h] + bias[h]

r (F + H*D) multiply-adds per token and kind instead of F*H*D. Closed form from the same moments: with W the
ridge weight (F, H*D) and C the inputs' centered Gram (F, F), the fitted values' scatter is W^T C W (H*D, H*D);
V (H*D, r) its top-r eigenvectors; W_r = W V V^T, so down = W V and up = V^T; the bias keeps the fitted means
(b_r = mean_y - mean_x W_r). The rank is `fit.low_rank.ranks`; at r >= H*D it is `linear` exactly.
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry


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


FAMILY = LowRank()
