"""The `calibration` section (stage `calibrate@<n>`): the curve's sizes and the candidates refitted at each."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.store.params import Params, Positive


class CalibrationParams(Params):
    # fit sequences per point, at most data.calibration_sequences, a calibrate@<n> stage each; []: no curve (reported)
    sizes: list[Annotated[int, Field(ge=2)]]
    # names of fit's candidates (linear_k1_lam0.001, mlp_k3, ...), or one distilled (`<name>+kl`, with the
    # distill section's settings): check_params refuses a map fit does not make
    candidates: Annotated[list[str], Field(min_length=1)]
    batch_size: Positive  # task requests per forward
