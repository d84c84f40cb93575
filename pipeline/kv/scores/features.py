"""The probe's inputs that are no gate score: the target's top-1 probability after the handoff, and the log-ratio of
the mapped cache's mean key and value norms to the source cache's. Their cost is counted in the probe's."""
from __future__ import annotations

from pipeline.kv.scores.base import Score, Work


class Feature(Score):
    def cost(self, work: Work) -> int:
        return 0  # counted by the probe (`kv.scores.probe`), once for every feature


class Top1(Feature):
    name = "top1"


class KeyNorm(Feature):
    name = "key_norm"


class ValueNorm(Feature):
    name = "value_norm"


TOP1, KEY_NORM, VALUE_NORM = Top1(), KeyNorm(), ValueNorm()
