"""The maths of `kl` (`kv/scores/kl.py`): the source's next-token distribution against the target's after the
handoff, the source's step run on its own cache."""
from __future__ import annotations

from pipeline.kv.scores import kl as declared
from pipeline.kv.scores.maths.base import Evidence, ScoreMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) (B,) of log-probabilities (B, V) over their common vocabulary (a padded vocabulary's tail cut)."""
    vocab = min(p_logprobs.shape[-1], q_logprobs.shape[-1])
    p, q = p_logprobs[..., :vocab], q_logprobs[..., :vocab]
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


class KLMaths(ScoreMaths):
    declaration = declared.SCORE

    def score(self, evidence: Evidence) -> torch.Tensor:
        first, target = evidence.first, evidence.logprobs
        source = evidence.scorer.source_alone.first_step(first.prefixes, prefilled=first.source).logprobs  # (B, V_s)
        return kl(source.to(target.device), target)


MATHS = KLMaths()
