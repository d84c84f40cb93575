"""The one list of the selectors' maths, keyed by the declarations' names (`kv.selectors.registry.SELECTORS`).

A declared policy without maths, or maths of no declared policy, is refused here, when the repair's run imports
the list. Adding a policy is its declaration and its maths, and a line in each registry (`kv.selectors.registry`).
"""
from __future__ import annotations

from typing import Mapping

from pipeline.kv import entries
from pipeline.kv.selectors.base import Selector
from pipeline.kv.selectors.maths import attention, deviation, key_norm, recency, source_attention
from pipeline.kv.selectors.maths.base import SelectorMaths
from pipeline.kv.selectors.registry import SELECTORS


def register(*maths: SelectorMaths, declared: Mapping[str, Selector] = SELECTORS) -> dict[str, SelectorMaths]:
    """The registry of `maths` by name, one for each selector of `declared` and for nothing else; anything but a
    `SelectorMaths` instance naming its declaration (and so one with a score) is refused."""
    return entries.register_maths(SelectorMaths, "selector maths", maths, declared)


SELECTOR_MATHS = register(deviation.MATHS, attention.MATHS, recency.MATHS, key_norm.MATHS, source_attention.MATHS)
