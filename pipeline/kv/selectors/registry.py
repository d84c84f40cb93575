"""The one list of the repair's token selectors (policies): their declarations.

Every other list of policies is derived from `SELECTORS` (`POLICIES`, the setting grammar's REPAIR_FORM and its
checks, the FLOP model's selection cost, the maths' registry, which refuses a declared policy without maths).
Adding a policy is adding its two modules, its declaration beside this one (`kv/selectors/<name>.py`) and its maths
(`kv/selectors/maths/<name>.py`), and their two lines: here and in `kv/selectors/maths/registry.py`.
"""
from __future__ import annotations

from pipeline.kv import entries
from pipeline.kv.selectors import attention, deviation, key_norm, recency, source_attention
from pipeline.kv.selectors.base import Selector


def register(*selectors: Selector) -> dict[str, Selector]:
    """The registry of `selectors` by name; anything but a named `Selector` instance (and so one with a cost) is
    refused."""
    return entries.register(Selector, "policies", selectors)


SELECTORS = register(deviation.SELECTOR, attention.SELECTOR, recency.SELECTOR, key_norm.SELECTOR,
                     source_attention.SELECTOR)
POLICIES = tuple(SELECTORS)
