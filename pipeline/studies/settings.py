"""The `report` section of params: the acceptance criteria declared before the run, and how the studies bin."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline.store.params import ParamError, Params, PositiveFloat, Share


class Criteria(Params):
    retention_floor: Share
    gap_closure_floor: Share  # of the source-to-oracle gap; needs the source baseline
    perplexity_ratio_limit: PositiveFloat
    agreement_milestone: Share  # on next-token top-1
    noninferiority_margin: Share


class ReportParams(Params):
    criteria: Criteria
    retention_metric: Literal["acc", "acc_norm"]
    # the gap-closure criterion's measure: task accuracy, or a per-prompt measure of the eval prompts (whose intervals
    # resolve at sizes where a 2-point task gap cannot)
    gap_closure_metric: Literal["tasks", "next_token_top1", "log_perplexity"]
    mapped_variant: str  # one of evaluate.mapped (check_params)
    # the length study's bins of task context length, as edges in multiples of the fit length: [1, 2, 4] bins
    # (0, 1], (1, 2], (2, 4] and beyond 4
    length_bins: Annotated[list[PositiveFloat], Field(min_length=1)]

    @model_validator(mode="after")
    def _increasing(self) -> ReportParams:
        if sorted(set(self.length_bins)) != self.length_bins:
            raise ParamError(f"report.length_bins: expected increasing edges, got {self.length_bins}")
        return self
