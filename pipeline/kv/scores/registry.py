"""The one list of the gate's scores, and of the probe's other inputs: their declarations.

Every other list of scores is derived from `SCORES` (the params' allowed values, the faces' choices, the fitted
ones, the probe's features, the FLOP model's score cost, what a scorer checks, the maths' registry, which refuses a
declared score without maths). Adding a score is adding its two modules, its declaration beside this one
(`kv/scores/<name>.py`) and its maths (`kv/scores/maths/<name>.py`), and their two lines: here and in
`kv/scores/maths/registry.py`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from pipeline.kv import entries
from pipeline.kv.scores import disagree, entropy, features, kl, probe
from pipeline.kv.scores.base import Score, Work


def register(*scores: Score) -> dict[str, Score]:
    """The registry of `scores` by name; anything but a named `Score` instance (and so one with a cost) is refused."""
    return entries.register(Score, "scores", scores)


SCORES = register(entropy.SCORE, kl.SCORE, disagree.SCORE, probe.SCORE)
INPUTS = register(features.TOP1, features.KEY_NORM, features.VALUE_NORM)  # the probe's inputs that are no score
FITTED_SCORES = tuple(name for name, score in SCORES.items() if score.fitted)  # not for a gate named by arguments alone
FEATURES = (*(name for name in SCORES if name not in FITTED_SCORES), *INPUTS)  # a probe's inputs (first step only)


def refusal(names: Sequence[str], scorer, scores: Mapping[str, Score]) -> str | None:
    """Why `scorer` cannot compute `names` from `scores` (and the probe's inputs): one unknown, or one whose needs
    are missing (and so for what it reads), or None."""
    known = {**scores, **INPUTS}
    for name in names:
        if name not in known:
            return f"unknown score {name!r} (known: {', '.join(scores)})"
        reason = known[name].refusal(scorer) or refusal(known[name].reads(scorer), scorer, scores)
        if reason:
            return reason
    return None


def score_macs(name: str, source_config, target_config, second_map_macs: int, length: int,
               features: Sequence[str] = FEATURES, scores: Mapping[str, Score] = SCORES) -> int:
    """Multiply-adds the score `name` adds to the handoff of a prompt of `length` tokens (the handoff's own first
    step is not counted again): its entry's `cost`; `second_map_macs`: `disagree`'s second map, per token;
    `features`: the probe's inputs."""
    if name not in scores:
        raise ValueError(f"unknown score {name!r} (known: {', '.join(scores)})")
    return scores[name].cost(Work(source_config, target_config, second_map_macs, length, tuple(features), scores))
