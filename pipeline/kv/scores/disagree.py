"""`disagree`: JS(p_target(. | map a), p_target(. | map b)), two maps (k=1 and k=max) disagreeing on the first step;
a second map over the prefix (the source's prefill shared) and a second target step."""
from __future__ import annotations

from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.scores.base import MAPS, Score, Work


class Disagree(Score):
    name = "disagree"
    needs = frozenset({MAPS})

    def cost(self, work: Work) -> int:
        target, prefix = work.target_config, work.length - 1
        return (prefix * work.second_map_macs + linear_macs_per_token(target)
                + attention_macs(target, prefix, work.length) + logits_macs(target))


SCORE = Disagree()
