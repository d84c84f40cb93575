"""The one list of the mapper families' maths, keyed by the declarations' names (`kv.families.registry.FAMILIES`).

A declared family without maths, or maths of no declared family, is refused here, when the mapper or the fit
imports the list. Adding a family is its declaration and its maths, and a line in each registry
(`kv.families.registry`).
"""
from __future__ import annotations

from typing import Mapping

from pipeline.kv import entries
from pipeline.kv.families.base import Family
from pipeline.kv.families.maths import head_matched, identity, linear, low_rank, mlp
from pipeline.kv.families.maths.base import FamilyMaths
from pipeline.kv.families.registry import FAMILIES


def register(*maths: FamilyMaths, declared: Mapping[str, Family] = FAMILIES) -> dict[str, FamilyMaths]:
    """The registry of `maths` by name, one for each family of `declared` and for nothing else; anything but a
    `FamilyMaths` instance naming its declaration is refused."""
    return entries.register_maths(FamilyMaths, "family maths", maths, declared)


FAMILY_MATHS = register(identity.MATHS, linear.MATHS, head_matched.MATHS, mlp.MATHS, low_rank.MATHS)
