"""The one list of the gate scores' maths and of the probe's other inputs', keyed by the declarations' names
(`kv.scores.registry.SCORES` and `INPUTS`).

A declared score or input without maths, or maths of nothing declared, is refused here, when the gate imports the
list. Adding a score is its declaration and its maths, and a line in each registry (`kv.scores.registry`).
"""
from __future__ import annotations

from typing import Mapping

from pipeline.kv import entries
from pipeline.kv.scores.base import Score
from pipeline.kv.scores.maths import disagree, entropy, features, kl, probe
from pipeline.kv.scores.maths.base import ScoreMaths
from pipeline.kv.scores.registry import INPUTS, SCORES


def register(*maths: ScoreMaths, declared: Mapping[str, Score] | None = None) -> dict[str, ScoreMaths]:
    """The registry of `maths` by name, one for each score and input of `declared` (default: `SCORES` and `INPUTS`)
    and for nothing else; anything but a `ScoreMaths` instance naming its declaration (and so one with a score) is
    refused."""
    return entries.register_maths(ScoreMaths, "score maths", maths, {**SCORES, **INPUTS} if declared is None
                                  else declared)


SCORE_MATHS = register(entropy.MATHS, kl.MATHS, disagree.MATHS, probe.MATHS, features.TOP1_MATHS,
                       features.KEY_NORM_MATHS, features.VALUE_NORM_MATHS)
