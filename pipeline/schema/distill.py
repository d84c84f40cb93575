"""The `distill` section: which fitted maps are trained further through the frozen target, and how."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.fitting.distill import DistillSettings
from pipeline.kv.families import TRAINABLE
from pipeline.kv.mapnames import MapName
from pipeline.store.params import ParamError, Positive, Processes


class DistillParams(DistillSettings):
    start: Annotated[list[str], Field(min_length=1)]  # fit's map names (the candidates fit writes)
    context_lengths: Annotated[list[Positive], Field(min_length=1)]  # n: the rows' prefixes are n - 1 tokens
    horizon: Annotated[int, Field(ge=0)]  # teacher-forced positions after the handoff position
    oracle_gib: Annotated[float, Field(ge=0)]  # each row and the target's own prefill of it kept across epochs and maps
    processes: Processes  # each distilling every N-th map (at most one per map)

    @model_validator(mode="after")
    def _families(self) -> "DistillParams":
        unknown = sorted(set(self.lrs) - set(TRAINABLE))
        if unknown:
            raise ParamError(f"distill.lrs: unknown family {unknown[0]!r} (trainable: {', '.join(TRAINABLE)})")
        for family, rates in self.lrs.items():
            if len(set(rates)) < len(rates):
                raise ParamError(f"distill.lrs.{family}: a rate is listed twice ({rates}); list each once")
        if len(set(self.kv_weights)) < len(self.kv_weights):
            raise ParamError(f"distill.kv_weights: a weight is listed twice ({self.kv_weights}); list each once")
        for name in self.start:
            try:
                family = MapName.parse(name).family
            except ValueError as err:
                raise ParamError(f"distill.start: {err}") from None
            if family not in self.lrs:
                raise ParamError(f"distill.start: {name!r} is a {family} map but distill.lrs has no {family} entry; "
                                 "add one")
        if min(self.context_lengths) < 2:
            raise ParamError("distill.context_lengths: a context needs at least 2 tokens (a prefix and its last)")
        return self
