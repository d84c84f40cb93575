"""The one list of the handoff modes' maths (their prefix hooks), keyed by the declarations' names
(`kv.modes.registry.MODES`).

A declared mode without maths, or maths of no declared mode, is refused here, when the handoff imports the list.
Adding a mode is its declaration and its maths, and a line in each registry (`kv.modes.registry`).
"""
from __future__ import annotations

from typing import Mapping

from pipeline.kv import entries
from pipeline.kv.modes.base import Mode
from pipeline.kv.modes.maths import direct, mapped, oracle, shuffled, source, speculative, zero
from pipeline.kv.modes.maths.base import ModeMaths
from pipeline.kv.modes.registry import MODES


def register(*maths: ModeMaths, declared: Mapping[str, Mode] = MODES) -> dict[str, ModeMaths]:
    """The registry of `maths` by name, one for each mode of `declared` and for nothing else; anything but a
    `ModeMaths` instance naming its declaration (and so one with a prefix hook) is refused."""
    return entries.register_maths(ModeMaths, "mode maths", maths, declared)


MODE_MATHS = register(oracle.MATHS, zero.MATHS, source.MATHS, direct.MATHS, mapped.MATHS, shuffled.MATHS,
                      speculative.MATHS)
