"""The `candidates` section of params.yaml, read by stage `candidates`: how every fitted map is timed and bounded."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.store.params import Count, ParamError, Params, Positive, Threads
from pipeline.store.shapes import PAIRS


class CandidatesParams(Params):
    length: Annotated[int, Field(ge=2)]  # prompt tokens of the time-to-first-token measurement
    warmup: Count  # untimed runs of both paths per candidate
    repeats: Positive  # timed runs of both paths per candidate (medians reported)
    bound_pair: str  # a pair of store.shapes.PAIRS: each candidate's FLOP bound at those shapes beside this pair's
    batch_size: Positive  # task requests per forward
    threads: Threads

    @model_validator(mode="after")
    def _known_pair(self) -> CandidatesParams:
        if self.bound_pair not in PAIRS:
            raise ParamError(f"candidates.bound_pair: unknown pair {self.bound_pair!r} (known: {', '.join(PAIRS)})")
        return self
