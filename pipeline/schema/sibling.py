"""The `sibling` section of params.yaml, read by stage `sibling`: which of the target's decoder layers a smaller
sibling keeps, and how it is healed by distillation from the target's logits."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline.store import paths
from pipeline.store.params import Count, ParamError, Params, Positive, PositiveFloat, Threads

INFLUENCE = "influence"  # sibling.keep: the layers of highest block influence on the healing rows


def names_sibling(source: str) -> bool:
    """Whether `models.source` names the sibling's folder (then stage `sibling` builds it)."""
    return Path(source) == paths.SIBLING


class SiblingParams(Params):
    layers: Annotated[int, Field(ge=2)]  # decoder layers kept: the sibling's prefill costs about layers / L
    keep: Literal["influence"] | list[Count]  # the rule, or the kept layers themselves (ascending target indices)
    influence_sequences: Positive  # healing rows the influence rule reads
    steps: Count  # AdamW steps of healing (0: pruned only)
    batch_sequences: Positive  # healing rows per step
    lr: PositiveFloat
    warmup_steps: Count  # linear warmup, then cosine decay to zero at `steps`
    weight_decay: Annotated[float, Field(ge=0)]
    max_seconds: PositiveFloat  # wall-clock cap of the whole build: healing stops at the first step past it
    curve_every: Positive  # steps between points of the healing curve
    curve_sequences: Positive  # select rows each point of the curve scores (the final figures read them all)
    seed: Count
    threads: Threads

    @model_validator(mode="after")
    def _kept_layers_are_a_list_of_layers(self) -> SiblingParams:
        if self.keep == INFLUENCE:
            return self
        if len(self.keep) != self.layers:
            raise ParamError(f"sibling.keep: {len(self.keep)} layers listed but sibling.layers is {self.layers}; "
                             f"list {self.layers} layers or write keep: influence")
        if any(later <= earlier for earlier, later in zip(self.keep, self.keep[1:])):
            raise ParamError(f"sibling.keep: {self.keep} is not strictly ascending; list each kept target layer "
                             f"once, in order")
        return self
