"""The `head_matched` family: like `linear`, but target head h reads only source head h of the k chosen layers
(a restricted map, kv_heads_s times fewer parameters); it needs equal KV head counts.

    weight (H, k*D_s, D), bias (H, D);  out[b, h, t] = inputs[b, h, t] @ weight[h] + bias[h]

Fitted in closed form, one ridge solve per head (the heads read different inputs).
"""
from __future__ import annotations

from pipeline.kv.families.base import Family, Geometry


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


FAMILY = HeadMatched()
