"""`disagree`: JS(p_target(. | map a), p_target(. | map b)), two maps (k=1 and k=max) disagreeing on the first step;
a second map over the prefix (the source's prefill shared) and a second target step."""
from __future__ import annotations

from pipeline.kv.flops import attention_macs, linear_macs_per_token, logits_macs
from pipeline.kv.scores.base import MAPS, Evidence, Score, Work
from pipeline.kv.scores.kl import kl
from pipeline.store.lazy import lazy

torch = lazy("torch")


def jensen_shannon(a_logprobs: torch.Tensor, b_logprobs: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (B,) of two next-token log-probabilities (B, V), in nats (at most log 2)."""
    middle = torch.logsumexp(torch.stack([a_logprobs, b_logprobs]), dim=0) - torch.log(torch.tensor(2.0))
    return 0.5 * (kl(a_logprobs, middle) + kl(b_logprobs, middle))


class Disagree(Score):
    name = "disagree"
    needs = frozenset({MAPS})

    def score(self, evidence: Evidence) -> torch.Tensor:
        first, scorer = evidence.first, evidence.scorer
        first_map, second_map = (evidence.logprobs if handoff is scorer.handoff else
                                 handoff.first_step(first.prefixes, prefilled=first.source).logprobs
                                 for handoff in scorer.disagree)  # (B, V) each
        return jensen_shannon(first_map, second_map.to(first_map.device))

    def cost(self, work: Work) -> int:
        target, prefix = work.target_config, work.length - 1
        return (prefix * work.second_map_macs + linear_macs_per_token(target)
                + attention_macs(target, prefix, work.length) + logits_macs(target))


SCORE = Disagree()
