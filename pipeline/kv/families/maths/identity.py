"""The maths of `identity` (`kv/families/identity.py`): none of its own. A map of no tensors hands the source's
layers over as they are (`kv.mapper.Mapper.apply_layer`), so it never projects and is never solved."""
from __future__ import annotations

from pipeline.kv.families import identity
from pipeline.kv.families.maths.base import FamilyMaths


class IdentityMaths(FamilyMaths):
    declaration = identity.FAMILY


MATHS = IdentityMaths()
