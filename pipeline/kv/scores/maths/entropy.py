"""The maths of `entropy` (`kv/scores/entropy.py`): the entropy of the target's next token after the handoff."""
from __future__ import annotations

from pipeline.kv.scores import entropy
from pipeline.kv.scores.maths.base import Evidence, ScoreMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


def next_token_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Entropy (B,) of next-token log-probabilities (B, V)."""
    return -(logprobs.exp() * logprobs).sum(-1)


class EntropyMaths(ScoreMaths):
    declaration = entropy.SCORE

    def score(self, evidence: Evidence) -> torch.Tensor:
        return next_token_entropy(evidence.logprobs)


MATHS = EntropyMaths()
