"""The `select` section: the prompts and rule choosing the map, the repair settings (`kv.repair`) chosen with it under a
declared budget, and the look-ahead (`kv.speculative`) that speculative prefill and source-ranked repairs read."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.kv.repair import Repair, parse_grid
from pipeline.kv.speculative import Lookahead
from pipeline.measure.prompt_metrics import PROMPT_METRICS
from pipeline.store.params import ParamError, Params, Positive, Processes
from pipeline.store.shapes import BoundPair


class SelectParams(Params):
    prompt_fraction: Annotated[float, Field(ge=0.05, le=0.95)]  # each sequence's context share, without prompt_lengths
    prompt_lengths: list[Annotated[int, Field(ge=2)]]  # else: each sequence's first n tokens, for each n, ...
    continuation: Positive | None  # ... and the next `continuation` tokens
    top_k: Positive
    horizon: Positive
    rule: str  # a prompt metric (measure.prompt_metrics), the map best by it (confident: measure.confident_margin)
    batch_size: Positive  # select prompts per forward
    processes: Processes  # sharing out the oracle's prompts, then the candidates
    repairs: list[str]  # kv.repair settings chosen with the map, `none` among them; [none]: the maps alone
    repair_maps: Positive  # the best maps by the rule unrepaired, each scored at every setting of `repairs`
    max_recompute: Annotated[float, Field(ge=0.0, le=1.0)]  # the largest budget chosen (kv.flops.repair_budget)
    bound_pair: BoundPair  # store.shapes.PAIRS or `loaded`: the budgets are counted at its shapes ...
    length: Annotated[int, Field(ge=2)]  # ... for prompts of this many tokens
    lookahead: list[Lookahead]  # the source layers and pooling speculative prefill may read, the best by the rule
    # at `lookahead_share` kept (ties: the first listed); []: params' `speculative` section as declared
    lookahead_share: Annotated[float, Field(gt=0, lt=1)]

    @model_validator(mode="after")
    def _checked(self) -> SelectParams:
        if self.rule not in PROMPT_METRICS:
            raise ParamError(f"select.rule: expected a prompt metric ({', '.join(PROMPT_METRICS)}), got {self.rule!r}")
        if self.prompt_lengths and self.continuation is None:
            raise ParamError("select.continuation: required with select.prompt_lengths (the tokens scored after each "
                             "prompt)")
        if len(set(self.prompt_lengths)) != len(self.prompt_lengths):
            raise ParamError(f"select.prompt_lengths: a length is listed twice in {self.prompt_lengths}")
        parse_grid(self.repairs, "select.repairs", "the maps unrepaired (they always compete, and V0's best map per "
                   "k is chosen among them)")
        return self

    def settings(self) -> list[Repair]:
        return [Repair.parse(text) for text in self.repairs]
