"""`entropy`: H(p_target(. | mapped)), the target unsure of its next token after the handoff; one pass over the
logits."""
from __future__ import annotations

from pipeline.kv.scores.base import Score, Work


class Entropy(Score):
    name = "entropy"

    def cost(self, work: Work) -> int:
        return work.target_config.vocab_size


SCORE = Entropy()
