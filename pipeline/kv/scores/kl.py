"""`kl`: KL(p_source || p_target(. | mapped)), the target after the handoff far from what the source predicts; the
source's step on c[n-1] after its own cache (shared with the handoff's prefill) and its logits."""
from __future__ import annotations

from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.scores.base import Evidence, Score, Work
from pipeline.store.lazy import lazy

torch = lazy("torch")


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) (B,) of log-probabilities (B, V) over their common vocabulary (a padded vocabulary's tail cut)."""
    vocab = min(p_logprobs.shape[-1], q_logprobs.shape[-1])
    p, q = p_logprobs[..., :vocab], q_logprobs[..., :vocab]
    return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)


class KL(Score):
    name = "kl"

    def score(self, evidence: Evidence) -> torch.Tensor:
        first, target = evidence.first, evidence.logprobs
        source = evidence.scorer.source_alone.first_step(first.prefixes, prefilled=first.source).logprobs  # (B, V_s)
        return kl(source.to(target.device), target)

    def cost(self, work: Work) -> int:
        source, prefix = work.source_config, work.length - 1
        return (linear_macs_per_token(source) + attention_macs(source, prefix, work.length) + logits_macs(source)
                + source.vocab_size)


SCORE = KL()
