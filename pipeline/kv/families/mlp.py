"""The `mlp` family: like `linear`, but through one hidden layer shared by the target heads of a layer.

    in_weight (F, hidden), in_bias (hidden,), weight (H, hidden, D), bias (H, D)
    hidden = gelu(inputs @ in_weight + in_bias);  out[b, h, t] = hidden[b, t] @ weight[h] + bias[h]

Trained, not solved: `fitting.mlpfit` trains each layer and kind (Adam, early stopping on held-out fit
sequences); its width is `fit.mlp.hidden`.
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry


class Mlp(Family):
    name = "mlp"
    tensor_names = ("in_weight", "in_bias", "weight", "bias")
    name_fields = ("k",)
    width_name = "hidden"
    width_param = "fit.mlp.hidden"  # params.yaml's key for its inner size(s)
    fitting = "trained"

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        if not width:
            raise ValueError("the mlp family's size needs its hidden width")
        inputs = k * geometry.heads_s * geometry.dim_s
        return (inputs, width), (width,), (geometry.heads_t, width, geometry.dim_t), (geometry.heads_t,
                                                                                    geometry.dim_t)

    def width(self, tensors: tuple) -> int | None:
        return tensors[0].shape[1]


FAMILY = Mlp()
