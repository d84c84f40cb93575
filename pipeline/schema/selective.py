"""The `selective` section: the maps gated, the gate's scores, the threshold's target and the per-request timing."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.kv.scores import SCORES
from pipeline.store.params import Count, ParamError, Params, Positive
from pipeline.store.shapes import BoundPair


class SelectiveParams(Params):
    maps: Annotated[dict[str, str], Field(min_length=1)]  # name -> mapper file (a stage's output): the maps gated
    scores: Annotated[list[str], Field(min_length=1)]  # kv.scores.SCORES compared, each once
    disagree: list[str]  # the `disagree` score's two mapper files: k=1 and k=max
    target_retention: Annotated[float, Field(gt=0, le=1)]  # the quality the dev threshold is chosen for
    probe_l2: Annotated[float, Field(gt=0)]  # the `probe` score's L2 penalty on its standardised weights
    probe_folds: Annotated[int, Field(ge=2)]  # folds of the dev items' out-of-fold probe scores (the threshold's)
    rates: Positive  # each curve at fallback rates 0, 1/rates, ..., 1
    length: Annotated[int, Field(ge=2)]  # prompt tokens of the per-request times
    warmup: Count
    repeats: Positive
    bound_pair: BoundPair  # store.shapes.PAIRS or `loaded`: the effective speedup bound at its shapes
    seed: int  # the gate's own draws (reference scores, ties along the curves); bootstraps: measure.bootstrap_seed
    batch_size: Positive

    @model_validator(mode="after")
    def _known(self) -> SelectiveParams:
        for name in self.scores:
            if name not in SCORES:
                raise ParamError(f"selective.scores: unknown score {name!r} (known: {', '.join(SCORES)})")
        twice = sorted({name for name in self.scores if self.scores.count(name) > 1})
        if twice:
            raise ParamError(f"selective.scores: {twice[0]!r} is listed twice; list each score once")
        if "disagree" in self.scores and len(set(self.disagree)) == 1 and len(self.disagree) == 2:
            raise ParamError(f"selective.disagree: the same file twice ({self.disagree[0]}); the score compares two "
                             f"maps (k=1 and k=max): name two different files")
        if "disagree" in self.scores and len(self.disagree) != 2:
            raise ParamError("selective.disagree: name two mapper files (k=1 and k=max) for the 'disagree' score")
        return self
