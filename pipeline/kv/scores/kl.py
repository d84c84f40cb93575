"""`kl`: KL(p_source || p_target(. | mapped)), the target after the handoff far from what the source predicts; the
source's step on c[n-1] after its own cache (shared with the handoff's prefill) and its logits."""
from __future__ import annotations

from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.scores.base import Score, Work


class KL(Score):
    name = "kl"

    def cost(self, work: Work) -> int:
        source, prefix = work.source_config, work.length - 1
        return (linear_macs_per_token(source) + attention_macs(source, prefix, work.length) + logits_macs(source)
                + source.vocab_size)


SCORE = KL()
