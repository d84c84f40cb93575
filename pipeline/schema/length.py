"""The `length` section: the fit length, the longer prompts and the map refitted with RoPE stripped and kept."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.store.params import Params, Positive


class LengthParams(Params):
    fit_tokens: Annotated[int, Field(ge=2)]  # the maps see each fit / select sequence's first fit_tokens tokens
    # prompt tokens evaluated (e.g. 1x, 2x, 4x fit_tokens)
    prompt_lengths: Annotated[list[Annotated[int, Field(ge=2)]], Field(min_length=1)]
    continuation: Positive  # tokens scored after each prompt
    candidate: str  # a candidate of the fit grid (fit's name; check_params refuses another), refitted both ways
    top_k: Positive
    horizon: Positive
    batch_size: Positive
