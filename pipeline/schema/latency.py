"""The `latency` section of params.yaml, read by stage `latency`: the prompt lengths, repeats and map of the
time-to-first-token measurement."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.measure.latency import check_lengths
from pipeline.store.params import Count, Dtype, Params, Positive


class LatencyParams(Params):
    lengths: list[Annotated[int, Field(ge=2)]]  # prompt lengths n; the handoff needs n >= 2
    warmup: Count  # untimed runs of both paths per length
    repeats: Positive  # timed runs of both paths per length
    dtype: Dtype
    mapper: str  # the mapper file timed: a stage's output (check_params), models/best/... or models/mapper.safetensors

    @model_validator(mode="after")
    def _lengths(self) -> LatencyParams:
        check_lengths(self.lengths, "latency.lengths")
        return self
