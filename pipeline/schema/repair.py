"""The `repair` section: the maps repaired, the settings grid (`kv.repair` strings), where cost is bounded and timed."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.kv.repair import Repair, parse_grid
from pipeline.store.params import Count, Params, Positive
from pipeline.store.shapes import BoundPair


class RepairParams(Params):
    maps: dict[str, str]  # name -> mapper file (a stage's output): the maps repaired
    grid: list[str]  # repair settings, kv.repair's string form (`none`, `layers:1`, `sink:4+tokens:0.1:attention`)
    bound_pair: BoundPair  # store.shapes.PAIRS or `loaded`: each setting's budget and speedup bound at its shapes
    length: Annotated[int, Field(ge=2)]  # prompt tokens of the budget, the bound and the measured times
    warmup: Count
    repeats: Positive
    batch_size: Positive

    @model_validator(mode="after")
    def _known(self) -> RepairParams:
        parse_grid(self.grid, "repair.grid", "the unrepaired map every setting is compared with")
        return self

    def settings(self) -> list[Repair]:
        return [Repair.parse(text) for text in self.grid]
