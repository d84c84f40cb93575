"""The `linear` family: V0's per-head linear map. Per target layer and kind, each target head's content is
predicted from the k chosen source layers, all source KV heads concatenated, with a bias; k=1 is V0's map.

    weight (H, F, D), bias (H, D);  out[b, h, t] = inputs[b, t] @ weight[h] + bias[h]

Fitted in closed form: all heads read the same inputs, so one ridge solve with every head's columns is exactly
the per-head fit.
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry


class Linear(Family):
    name = "linear"
    tensor_names = ("weight", "bias")
    name_fields = ("k", "lambda")
    fitting = "closed_form"
    scale_check = True

    def shapes(self, geometry: Geometry, k: int, width: int | None):
        return (geometry.heads_t, k * geometry.heads_s * geometry.dim_s, geometry.dim_t), (geometry.heads_t,
                                                                                       geometry.dim_t)


FAMILY = Linear()
