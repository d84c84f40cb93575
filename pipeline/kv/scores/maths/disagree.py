"""The maths of `disagree` (`kv/scores/disagree.py`): the Jensen-Shannon divergence of the target's first steps
after the two maps, the second map run over the source's shared prefill."""
from __future__ import annotations

from pipeline.kv.scores import disagree
from pipeline.kv.scores.maths.base import Evidence, ScoreMaths
from pipeline.kv.scores.maths.kl import kl
from pipeline.store.lazy import lazy

torch = lazy("torch")


def jensen_shannon(a_logprobs: torch.Tensor, b_logprobs: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence (B,) of two next-token log-probabilities (B, V), in nats (at most log 2)."""
    middle = torch.logsumexp(torch.stack([a_logprobs, b_logprobs]), dim=0) - torch.log(torch.tensor(2.0))
    return 0.5 * (kl(a_logprobs, middle) + kl(b_logprobs, middle))


class DisagreeMaths(ScoreMaths):
    declaration = disagree.SCORE

    def score(self, evidence: Evidence) -> torch.Tensor:
        first, scorer = evidence.first, evidence.scorer
        first_map, second_map = (evidence.logprobs if handoff is scorer.handoff else
                                 handoff.first_step(first.prefixes, prefilled=first.source).logprobs
                                 for handoff in scorer.disagree)  # (B, V) each
        return jensen_shannon(first_map, second_map.to(first_map.device))


MATHS = DisagreeMaths()
