"""The maths of the probe's other inputs (`kv/scores/features.py`): the target's top-1 probability after the handoff,
and the log-ratios of the mapped cache's mean key and value norms to the source cache's."""
from __future__ import annotations

from pipeline.kv.scores import features
from pipeline.kv.scores.maths.base import Evidence, ScoreMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Top1Maths(ScoreMaths):
    declaration = features.TOP1

    def score(self, evidence: Evidence) -> torch.Tensor:
        return evidence.logprobs.max(-1).values.exp()


class KeyNormMaths(ScoreMaths):
    declaration = features.KEY_NORM

    def score(self, evidence: Evidence) -> torch.Tensor:
        (mapped, _), (source, _) = evidence.norms
        return (mapped / source).log()


class ValueNormMaths(ScoreMaths):
    declaration = features.VALUE_NORM

    def score(self, evidence: Evidence) -> torch.Tensor:
        (_, mapped), (_, source) = evidence.norms
        return (mapped / source).log()


TOP1_MATHS, KEY_NORM_MATHS, VALUE_NORM_MATHS = Top1Maths(), KeyNormMaths(), ValueNormMaths()
