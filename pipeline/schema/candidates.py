"""The `candidates` section of params.yaml, read by stage `candidates`: how every fitted map is timed and bounded."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.store.params import Count, Params, Positive
from pipeline.store.shapes import BoundPair


class CandidatesParams(Params):
    length: Annotated[int, Field(ge=2)]  # prompt tokens of the time-to-first-token measurement
    warmup: Count  # untimed runs of both paths per candidate
    repeats: Positive  # timed runs of both paths per candidate (medians reported)
    bound_pair: BoundPair  # store.shapes.PAIRS or `loaded`: each candidate's FLOP bound at its shapes beside ours
    batch_size: Positive  # task requests per forward
