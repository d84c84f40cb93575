"""`probe`: a logistic regression's logit for "the map changes the decision" from the first step's features (the
scores but itself, the target's top-1 probability, the caches' norm ratios), trained by the selective stage on dev
items only (`kv.gate.Probe`); its features' costs, a pass over the logits (top-1), one over both caches (norms) and
its dot product."""
from __future__ import annotations

from pipeline.kv.geometry import kv_geometry
from pipeline.kv.scores.base import PROBE, Score, Work


class Probe(Score):
    name = "probe"
    needs = frozenset({PROBE})
    fitted = True

    def reads(self, scorer) -> tuple[str, ...]:
        return tuple(scorer.probe.features)

    def cost(self, work: Work) -> int:
        prefix = work.length - 1
        norms = prefix * sum(geometry["layers"] * geometry["kv_heads"] * geometry["head_dim"] * 2
                             for geometry in (kv_geometry(work.source_config), kv_geometry(work.target_config)))
        return (sum(work.scores[feature].cost(work) for feature in work.features if feature in work.scores)
                + work.target_config.vocab_size + norms + len(work.features))


SCORE = Probe()
