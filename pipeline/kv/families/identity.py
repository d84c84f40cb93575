"""The `identity` family: the source cache as it is, defined only when the two KV geometries are equal (what
direct injection passes)."""
from __future__ import annotations

from pipeline.kv.families.base import Family


class Identity(Family):
    name = "identity"
    tensor_names = ()
    name_fields = ()
    trainable = False

    def requirement(self, source: dict, target: dict) -> str | None:
        if source == target:
            return None
        return f"the identity map needs equal KV geometry, but the source has {source} and the target {target}"

    def shapes(self, geometry, k, width):
        return ()


FAMILY = Identity()
