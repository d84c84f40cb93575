"""The `select` section of params.yaml, read by stage `select`: the prompts and the rule that choose the map."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.store.params import Params, Positive, Processes, Threads


class SelectParams(Params):
    prompt_fraction: Annotated[float, Field(ge=0.05, le=0.95)]
    top_k: Positive
    horizon: Positive
    rule: Literal["agreement", "perplexity", "kl", "attention_cosine"]
    batch_size: Positive  # select prompts per forward
    threads: Threads
    processes: Processes  # sharing out the oracle's prompts, then the candidates
