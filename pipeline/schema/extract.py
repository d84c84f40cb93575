"""The `extract` section of params.yaml, read by stage `extract`: how the caches are stored, batched and timed."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.store.params import Dtype, Params, Positive, PositiveFloat, Processes


class ExtractParams(Params):
    dtype: Dtype  # storage dtype of the cached keys and values
    shard_sequences: Positive  # sequences per shard: memory is bounded by about three shards
    batch_sequences: Positive  # sequences of one length run through the model in one forward
    splits: Annotated[list[str], Field(min_length=1)]
    repeats: Positive  # timed extractions, each beside both floors; medians reported
    processes: Processes  # the caches do not depend on it
    target_ratio: PositiveFloat  # the extraction time aimed at, in multiples of the slower floor (reported beside)
