"""The `controls` and `tolerances` sections: how much each control runs, and the exactness control's tolerances."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.store.params import Params, Positive, PositiveFloat


class Float32Tolerance(Params):
    noise_multiple: PositiveFloat  # |delta log p| allowed, in multiples of the model's noise floor
    rope_relative: PositiveFloat  # max |strip(cached keys) - pre-RoPE keys| / max |pre-RoPE keys|


class ReducedTolerance(Params):
    decision_margin: Annotated[float, Field(ge=0)]  # a decision whose top-two margin is below this may flip
    noise_multiple: PositiveFloat  # |delta log p| allowed, in multiples of the model's noise floor in this dtype


class ToleranceParams(Params):
    float32: Float32Tolerance
    bfloat16: ReducedTolerance  # also used for float16


class ControlsParams(Params):
    prompts: Positive  # eval prompts the decode and RoPE controls run on
    horizon: Positive
    corruption_flips: Positive
