"""The maths of `probe` (`kv/scores/probe.py`): the scorer's fitted probe (`kv.gate.Probe`) on the features computed
before it."""
from __future__ import annotations

from pipeline.kv.scores import probe
from pipeline.kv.scores.maths.base import Evidence, ScoreMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class ProbeMaths(ScoreMaths):
    declaration = probe.SCORE

    def score(self, evidence: Evidence) -> torch.Tensor:
        return evidence.scorer.probe(evidence.values)


MATHS = ProbeMaths()
