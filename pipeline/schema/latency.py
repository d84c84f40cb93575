"""The `latency` section: the prompt lengths, repeats and map of the time-to-first-token measurement, and the
repaired maps and speculative shares timed beside it, part by part."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from pipeline.kv.repair import Repair, RepairError
from pipeline.measure.latency import check_lengths
from pipeline.store.devices import ModelDtype
from pipeline.store.params import Count, ParamError, Params, Positive


class LatencyParams(Params):
    lengths: list[Annotated[int, Field(ge=2)]]  # prompt lengths n; the handoff needs n >= 2
    warmup: Count  # untimed runs of both paths per length
    repeats: Positive  # timed runs of both paths per length
    dtype: ModelDtype  # float32, bfloat16, float16 or auto (machine_dtype)
    mapper: str  # the mapper file timed: a stage's output (check_params), models/best/... or models/mapper.safetensors
    repairs: list[str]  # kv.repair settings: the mapper with each, timed beside it (the hybrid: source_attention)
    speculative: list[Annotated[float, Field(gt=0, le=1)]]  # speculative prefill at each share p, timed beside it

    @model_validator(mode="after")
    def _checked(self) -> LatencyParams:
        check_lengths(self.lengths, "latency.lengths")
        try:
            settings = [Repair.parse(text) for text in self.repairs]
        except RepairError as error:
            raise ParamError(f"latency.repairs: {error}") from None
        if any(setting.empty for setting in settings):
            raise ParamError("latency.repairs: drop `none` (the map unrepaired is always timed)")
        if len({str(setting) for setting in settings}) != len(settings) or len(set(self.speculative)) != len(
                self.speculative):
            raise ParamError("latency.repairs, latency.speculative: a setting is listed twice; list each once")
        return self

    def settings(self) -> list[Repair]:
        return [Repair.parse(text) for text in self.repairs]
