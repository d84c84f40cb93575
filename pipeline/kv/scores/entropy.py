"""`entropy`: H(p_target(. | mapped)), the target unsure of its next token after the handoff; one pass over the
logits."""
from __future__ import annotations

from pipeline.kv.scores.base import Evidence, Score, Work
from pipeline.store.lazy import lazy

torch = lazy("torch")


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) of next-token log-probabilities (B, V)."""
    return -(logprobs.exp() * logprobs).sum(-1)


class Entropy(Score):
    name = "entropy"

    def score(self, evidence: Evidence) -> torch.Tensor:
        return entropy(evidence.logprobs)

    def cost(self, work: Work) -> int:
        return work.target_config.vocab_size


SCORE = Entropy()
